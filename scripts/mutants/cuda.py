"""Mutants of the CUDA engine: each reverts one fix; the named
tests (fake CUDA runtime, CPU CI) must fail with it. See README.md here."""

FAKE = "tests/test_cuda_fake.py"

MUTANTS = [
    dict(
        name="cuda-last-error-not-cleared",
        file="csrc/cuda/cuda_engine.cpp",
        find="void clear_last_error() { (void)api().get_last_error(); }",
        replace="void clear_last_error() {}",
        tests=[FAKE + "::test_finding_1_failed_calls_do_not_leave_the_last_error"],
        why="review finding 1: a failed cudaHostRegister or a cudaErrorNotReady from polling stays "
            "the runtime's last error, and torch's next launch check raises it",
    ),
    dict(
        name="cuda-batch-api-by-build-only",
        file="csrc/cuda/cuda_engine.cpp",
        find="state.usable = r == cudaSuccess && d == cudaSuccess && runtime >= kBatchMinVersion &&\n"
             "                   driver >= kBatchMinVersion;",
        replace="state.usable = true;",
        tests=[FAKE + "::test_finding_2_the_batch_api_is_resolved_at_run_time"],
        why="review finding 2: a 12.8+ runtime under an older driver calls the batch API anyway",
    ),
    dict(
        name="cuda-batch-unsupported-not-latched",
        file="csrc/cuda/cuda_engine.cpp",
        find="  return err == cudaErrorNotSupported || err == cudaErrorInsufficientDriver ||\n"
             "         err == cudaErrorCallRequiresNewerDriver;",
        replace="  return false;",
        tests=[FAKE + "::test_finding_2_an_unsupported_batch_api_latches_per_descriptor_copies"],
        why="review finding 2: 'not supported' / 'insufficient driver' fails the copy instead of "
            "falling back to per-descriptor copies for that device",
    ),
    dict(
        name="cuda-batch-attrs-per-descriptor",
        file="csrc/cuda/cuda_engine.cpp",
        find="&args->attr, &args->index, 1, &fail_index, stream);",
        replace="std::vector<cudaMemcpyAttributes>(static_cast<size_t>(b.count), args->attr).data(),\n"
                "[&b] { std::vector<size_t> i(static_cast<size_t>(b.count)); "
                "for (size_t k = 0; k < i.size(); ++k) i[k] = k; return i; }().data(),\n"
                "static_cast<size_t>(b.count), &fail_index, stream);",
        tests=[FAKE + "::test_finding_3_one_attrs_entry_with_index_zero"],
        why="review finding 3: one attrs entry and one index per descriptor, built on every call",
    ),
    dict(
        name="cuda-event-query-in-global-mode",
        file="csrc/cuda/cuda_engine.cpp",
        find="    KVSWAP_CUDA_CHECK(api().thread_exchange_stream_capture_mode(&mode));\n",
        replace="",
        tests=[FAKE + "::test_finding_4_polling_in_flight_batches_leaves_another_threads_capture_valid"],
        why="review finding 4: cudaEventQuery while another thread captures in global mode fails "
            "and invalidates that capture",
    ),
    dict(
        name="cuda-pointer-attributes-before-the-guard",
        file="csrc/cuda/cuda_engine.cpp",
        find="  DeviceScope scope(index);\n  std::optional<RelaxedCaptureMode> relaxed;",
        replace="  (void)index;\n  std::optional<RelaxedCaptureMode> relaxed;",
        tests=[FAKE + "::test_finding_5_pointer_attributes_once_per_host_storage_with_the_device_current"],
        why="review finding 5: cudaPointerGetAttributes answers for the current device, which is "
            "not yet the target device",
    ),
    dict(
        name="cuda-pointer-attributes-per-tensor",
        file="csrc/cuda/cuda_engine.cpp",
        find="    if (std::find(asked.begin(), asked.end(), p) != asked.end()) return true;\n",
        replace="",
        tests=[FAKE + "::test_finding_5_pointer_attributes_once_per_host_storage_with_the_device_current"],
        why="review finding 5: one cudaPointerGetAttributes per cache tensor on every call",
    ),
    dict(
        name="cuda-kernel-one-thread-block-per-block",
        file="csrc/cuda/copy_kernel.h",
        find="constexpr int64_t kSliceBytes = 16 * 1024;",
        replace="constexpr int64_t kSliceBytes = int64_t{1} << 40;",
        tests=[FAKE + "::test_finding_7_large_blocks_spread_over_many_thread_blocks"],
        why="review finding 7: a few large blocks keep a few SMs busy",
    ),
    dict(
        name="cuda-kernel-byte-loop",
        file="csrc/cuda/copy_kernel.h",
        find="  if ((rel & 15) == 0) {\n    copy_words<Vec16>(from, to, bytes, tid, nthreads);\n  } else if",
        replace="  if (((rel | static_cast<uintptr_t>(bytes)) & 15) == 0) {\n"
                "    copy_words<Vec16>(from, to, bytes, tid, nthreads);\n  } else if (true) {\n"
                "    copy_words<uint8_t>(from, to, bytes, tid, nthreads);\n  } else if",
        tests=[FAKE + "::test_finding_7_sizes_not_a_multiple_of_16_copy_in_16_byte_words"],
        why="review finding 7: a block size that is not a multiple of 16 bytes is copied byte by byte",
    ),
    dict(
        name="cuda-host-ids-moved-to-the-device",
        file="csrc/core/ops.cpp",
        find="  const auto sid = src_block_ids.contiguous();\n  const auto did = dst_block_ids.contiguous();",
        replace="  const auto sid = src_block_ids.to(device, /*non_blocking=*/false).contiguous();\n"
                "  const auto did = dst_block_ids.to(device, /*non_blocking=*/false).contiguous();",
        tests=[FAKE + "::test_host_ids_on_the_kernel_path_under_capture_need_no_transfer",
               FAKE + "::test_copies_land_on_the_stream_without_syncing"],
        why="capture: host ids went to the device with a pageable, synchronizing copy, illegal "
            "under capture and a stall for the offloader's store()/load()",
    ),
    dict(
        name="cuda-device-ids-under-capture-refused",
        file="csrc/core/ops.cpp",
        find="(small || capturing)",
        replace="small",
        tests=[FAKE + "::test_auto_routes_device_ids_under_capture_to_the_kernel"],
        why="capture: device ids with large blocks were refused (or read back) instead of taking "
            "the kernel, which reads them at replay",
    ),
    dict(
        name="cuda-capture-query-unregistered",
        file="csrc/cuda/cuda_engine.cpp",
        find='  m.impl("_stream_capturing", &stream_capturing_cuda);\n',
        replace="",
        tests=[FAKE + "::test_capture_and_replay"],
        why="capture: without the CUDA engine's answer the core never knows a capture is on",
    ),
    # --- descriptor tables held until the copy is known finished ---
    dict(
        name="cuda-inflight-released-when-record-fails",
        file="csrc/engine_common.h",
        find="      free_.push_back(event);\n      throw;",
        replace="      free_.push_back(event);\n      live_.pop_back();\n      throw;",
        tests=[FAKE + "::test_a_batch_whose_event_fails_stays_held"],
        why="a batch whose event could not be recorded is released while its copy is queued; the "
            "pool hands its descriptor table to the next call",
    ),
    dict(
        name="cuda-inflight-held-after-the-event",
        file="csrc/engine_common.h",
        find="    live_.push_back(Entry{Event{}, stream, false, std::move(tensors), std::move(extra)});\n"
             "    Entry& entry = live_.back();  // deque: push_back keeps references valid\n"
             "    const Event event = free_.empty() ? Runtime::create_event() : take_free();",
        replace="    const Event event = free_.empty() ? Runtime::create_event() : take_free();\n"
                "    live_.push_back(Entry{Event{}, stream, false, std::move(tensors), std::move(extra)});\n"
                "    Entry& entry = live_.back();",
        tests=[FAKE + "::test_a_batch_whose_event_fails_stays_held"],
        why="a failed cudaEventCreateWithFlags after a queued batch releases its descriptor table",
    ),
    dict(
        name="cuda-inflight-polled-before-held",
        file="csrc/engine_common.h",
        find="    std::lock_guard<std::mutex> lock(mutex_);\n    live_.push_back(",
        replace="    std::lock_guard<std::mutex> lock(mutex_);\n    retire_locked(live_.size());\n    live_.push_back(",
        tests=[FAKE + "::test_a_batch_stays_held_when_polling_earlier_batches_fails"],
        why="a failed poll of earlier batches, before the queued batch is held, releases its table",
    ),
    dict(
        name="cuda-inflight-eventless-never-retired",
        file="csrc/engine_common.h",
        find="        done = std::find(finished.begin(), finished.end(), it->stream) != finished.end();",
        replace="        done = false;",
        tests=[FAKE + "::test_a_batch_whose_event_fails_stays_held"],
        why="a batch without an event is held for ever, though a later event of its stream completed",
    ),
    # --- pinned host tensors: the allocator learns the copy's stream ---
    dict(
        name="cuda-pinned-use-not-recorded-dma",
        file="csrc/core/ops.cpp",
        find="  if (route.device.is_cuda()) record_host_use(src_caches, dst_caches, route.device);\n",
        replace="",
        tests=[FAKE + "::test_a_pinned_host_tensor_freed_while_its_copy_is_queued_is_not_reused"],
        why="a pinned tensor freed after a queued DMA copy is handed out again before the copy ran",
    ),
    dict(
        name="cuda-pinned-use-not-recorded-kernel",
        file="csrc/core/ops.cpp",
        find="    // The kernel reads or writes the mapped host caches when it runs.\n"
             "    record_host_use(src_caches, dst_caches, route.device);\n",
        replace="",
        tests=[FAKE + "::test_a_pinned_host_tensor_freed_while_its_copy_is_queued_is_not_reused"],
        why="a pinned tensor freed after a queued kernel is handed out again before the kernel ran",
    ),
    # --- the pointer query under capture ---
    dict(
        name="cuda-pointer-query-in-global-mode",
        file="csrc/cuda/cuda_engine.cpp",
        find="    if (!relaxed) relaxed.emplace();\n",
        replace="",
        tests=[FAKE + "::test_the_pointer_query_is_safe_under_capture_either_way"],
        why="where cudaPointerGetAttributes is a potentially unsafe call, asking it in global mode "
            "during capture fails and invalidates the capture",
    ),
    dict(
        name="cuda-pointer-query-errors-read-as-unmapped",
        file="csrc/cuda/cuda_engine.cpp",
        find="  if (err == cudaErrorInvalidValue) {\n    clear_last_error();\n    return false;\n  }",
        replace="  if (err != cudaSuccess) {\n    clear_last_error();\n    return false;\n  }",
        tests=[FAKE + "::test_after_a_sticky_error_every_call_answers_it"],
        why="a sticky error from the pointer query reads as 'not mapped' and the message blames the "
            "caller's memory",
    ),
    # --- kernel parameters ---
    dict(
        name="cuda-small-params-only",
        file="csrc/cuda/cuda_engine.cpp",
        find="  if (param_limit(index) == kLargeParamLimit) {",
        replace="  if (false) {",
        tests=[FAKE + "::test_launches_per_4096_host_ids_with_each_parameter_limit"],
        why="4 KiB of kernel parameters everywhere: 9 launches for 4,096 host ids where 2 do",
    ),
    dict(
        name="cuda-large-params-ignore-driver",
        file="csrc/cuda/cuda_engine.cpp",
        find="            driver >= kLargeParamsMinVersion && major >= kLargeParamsMinMajor;",
        replace="            major >= kLargeParamsMinMajor;",
        tests=[FAKE + "::test_launches_per_4096_host_ids_with_each_parameter_limit"],
        why="large parameters under a driver before 12.1: the launch fails (not supported)",
    ),
    dict(
        name="cuda-large-params-ignore-runtime",
        file="csrc/cuda/cuda_engine.cpp",
        find="runtime >= kLargeParamsMinVersion &&\n",
        replace="true &&\n",
        tests=[FAKE + "::test_launches_per_4096_host_ids_with_each_parameter_limit"],
        why="large parameters under a runtime before 12.1: the launch fails",
    ),
    dict(
        name="cuda-large-params-ignore-architecture",
        file="csrc/cuda/cuda_engine.cpp",
        find="major >= kLargeParamsMinMajor;",
        replace="true;",
        tests=[FAKE + "::test_launches_per_4096_host_ids_with_each_parameter_limit"],
        why="large parameters on a device before sm_70, where the limit stays 4 KiB",
    ),
    # --- the fake's rules ---
    dict(
        name="fake-cuda-sticky-error-cleared",
        file="tests/fake_cuda/fake_cuda_runtime.cpp",
        find="  t_last_error = world().sticky;",
        replace="  t_last_error = cudaSuccess;",
        tests=[FAKE + "::test_after_a_sticky_error_every_call_answers_it"],
        why="the fake lets cudaGetLastError clear a sticky error (driver_types.h:771-772)",
    ),
    dict(
        name="fake-cuda-sticky-error-not-answered",
        file="tests/fake_cuda/fake_cuda_runtime.cpp",
        find="    if (world().sticky != cudaSuccess) return note(api, stream, world().sticky); \\",
        replace="    if (false) return note(api, stream, world().sticky); \\",
        tests=[FAKE + "::test_after_a_sticky_error_every_call_answers_it"],
        why="after a sticky error the fake's calls succeed, where CUDA answers the error",
    ),
    dict(
        name="fake-cuda-invalidated-capture-records",
        file="tests/fake_cuda/fake_cuda_runtime.cpp",
        find="    if (s->capture->invalidated) return cudaErrorStreamCaptureInvalidated;\n",
        replace="",
        tests=[FAKE + "::test_an_invalidated_capture_answers_901_to_further_work"],
        why="an invalidated capture keeps recording work; CUDA answers 901 (driver_types.h:1019-1022)",
    ),
    dict(
        name="fake-cuda-pointer-query-always-legal",
        file="tests/fake_cuda/fake_cuda_runtime.cpp",
        find="  if (w.faults.pointer_query_unsafe && unsafe_prohibited()) {",
        replace="  if (false) {",
        tests=[FAKE + "::test_the_fake_refuses_the_pointer_query_under_global_capture_in_that_mode"],
        why="the fake's mode where the pointer query is a potentially unsafe call does nothing",
    ),
    dict(
        name="fake-cuda-param-limit-unenforced",
        file="tests/fake_cuda/fake_cuda_runtime.cpp",
        find="  return large ? cudaSuccess : cudaErrorNotSupported;",
        replace="  return cudaSuccess;",
        tests=[FAKE + "::test_the_fake_enforces_the_parameter_limit"],
        why="the fake launches more than 4 KiB of parameters on an old driver or a pre-Volta device",
    ),
    dict(
        name="fake-cuda-pinned-block-reused-at-once",
        file="tests/fake_cuda/fake_cuda_module.cpp",
        find="      for (const auto& [s, at] : b.uses) idle = idle && fake_cuda::stream_reached(s, at);\n",
        replace="",
        tests=[FAKE + "::test_a_pinned_host_tensor_freed_while_its_copy_is_queued_is_not_reused"],
        why="the fake pinned allocator ignores recorded streams, so no engine could be caught",
    ),
    dict(
        name="cuda-per-copy-error-hides-queued-copies",
        file="csrc/cuda/cuda_engine.cpp",
        find='format_descriptor(b, i), i > 0 ? "; " + copies_left_behind(i, b.count) : "");',
        replace='format_descriptor(b, i));',
        tests=[FAKE + "::test_a_per_copy_failure_names_the_descriptors_already_queued_and_they_land"],
        why="a failure at descriptor k of the per-copy path must say that descriptors 0..k-1 were queued "
            "and will still run",
    ),
    dict(
        name="cuda-submit-error-does-not-say-nothing-was-copied",
        file="csrc/cuda/cuda_engine.cpp",
        find="    copy_each(batch, stream, queued);\n  } catch (c10::Error& e) {\n    if (!queued) e.add_context(kNothingCopied);",
        replace="    copy_each(batch, stream, queued);\n  } catch (c10::Error& e) {",
        tests=[FAKE + "::test_an_engine_error_before_any_copy_says_nothing_was_copied",
               FAKE + "::test_a_failure_of_the_first_copy_says_nothing_was_copied"],
        why="an engine error raised before any copy was queued must say that nothing was copied",
    ),
    dict(
        name="cuda-failed-batch-claims-nothing-was-copied",
        file="csrc/cuda/cuda_engine.cpp",
        find="      queued = true;\n      if (copy_batched(",
        replace="      if (copy_batched(",
        tests=[FAKE + "::test_a_failed_batch_says_its_copies_may_have_been_queued"],
        why="a failed batch call may have queued part of its copies: its error must not say nothing "
            "was copied",
    ),
    dict(
        name="cuda-kernel-error-hides-earlier-launches",
        file="csrc/cuda/cuda_engine.cpp",
        find='queued ? "; " + launched_before(first_id, first_id + count - 1, first_pair) : "");',
        replace='"");',
        tests=[FAKE + "::test_a_kernel_launch_failure_names_the_launches_already_queued"],
        why="a failed launch after earlier launches of the call must say which ids and pairs they copy",
    ),
    dict(
        name="cuda-kernel-launch-error-drops-the-earlier-pairs",
        file="csrc/cuda/cuda_engine.cpp",
        find='  if (first_pair > 0) out << "ids " << first_id << ".." << last_id << " of pairs 0.." << first_pair - 1;',
        replace="",
        tests=[FAKE + "::test_a_kernel_launch_failure_names_the_launches_already_queued"],
        why="the launches of the current ids for the pairs before the failing launch ran too",
    ),
    # --- pinned means every byte (issue 25) ---
    dict(
        name="cuda-mapped-by-storage-base",
        file="csrc/cuda/cuda_engine.cpp",
        find="    switch (registrations().coverage(lo, hi, starts)) {",
        replace="    (void)registrations().coverage(lo, hi, starts);\n    switch (Coverage::kNone) {",
        tests=[FAKE + "::test_a_registered_view_at_an_offset_is_mapped_and_the_kernel_copies_into_it",
               FAKE + "::test_a_registered_prefix_does_not_make_the_whole_tensor_mapped"],
        why="only the storage base is asked: a registered view at an offset reads as pageable, a "
            "registered prefix as mapped for the whole tensor (the kernel touches unregistered pages)",
    ),
    dict(
        name="cuda-registration-gap-ignored",
        file="csrc/engine_common.h",
        find="    if (it->first > covered) return Coverage::kPartial;  // a gap before this one\n",
        replace="",
        tests=[FAKE + "::test_a_gap_between_two_registrations_is_not_mapped_and_adjacent_ones_are",
               "tests/test_ascend_fake.py::test_fake_npu[main-cases_cann-"
               "test_a_gap_between_two_registrations_is_not_pinned_and_adjacent_ones_are]"],
        why="a pageable page between two registrations reads as mapped (CUDA) or pinned "
            "(Ascend): both engines share RegisteredRanges",
    ),
    dict(
        name="cuda-mapped-without-the-runtimes-opinion",
        file="csrc/cuda/cuda_engine.cpp",
        find="          if (!mapped_at(reinterpret_cast<const void*>(start))) return false;",
        replace="          (void)start;",
        tests=[FAKE + "::test_the_runtime_has_a_second_opinion_on_registered_bytes"],
        why="the engine's table alone decides, though the runtime no longer has the registration",
    ),
    dict(
        name="cuda-mapped-range-ignores-strides",
        file="csrc/engine_common.h",
        find="  return {first, first + static_cast<uintptr_t>((last + 1) * static_cast<int64_t>(t.element_size()))};",
        replace="  return {first, first + t.nbytes()};",
        tests=[FAKE + "::test_a_strided_host_view_is_judged_by_every_byte_it_spans"],
        why="a strided view is judged by as many bytes as its elements, from its first: its last "
            "rows may lie outside the registration",
    ),
    # --- the device (issue 25) ---
    dict(
        name="cuda-device-scope-restore-throws",
        file="csrc/cuda/cuda_engine.cpp",
        find="  ~DeviceScope() {\n    if (previous_ == device_) return;\n",
        replace="  ~DeviceScope() {\n    if (previous_ != device_) api().exchange_device(previous_);\n    return;\n",
        tests=[FAKE + "::test_a_refused_device_restore_warns_once_and_never_throws"],
        why="a refused restore throws from a destructor: the process terminates",
    ),
    dict(
        name="cuda-kernel-without-device-scope",
        file="csrc/cuda/cuda_engine.cpp",
        find="  if (n == 0 || pairs.empty()) return;\n\n  DeviceScope scope(index);\n",
        replace="  if (n == 0 || pairs.empty()) return;\n\n",
        tests=[FAKE + "::test_copies_on_a_device_that_is_not_current"],
        why="the kernel launches with another device current: refused on its stream, or run on "
            "the wrong device's legacy stream",
    ),
    dict(
        name="cuda-submit-without-device-scope",
        file="csrc/cuda/cuda_engine.cpp",
        find="    DeviceScope scope(index);\n    const cudaStream_t stream = api().current_stream(index);\n",
        replace="    const cudaStream_t stream = api().current_stream(index);\n",
        tests=[FAKE + "::test_copies_on_a_device_that_is_not_current"],
        why="the batch's completion event is created on the current device, not the stream's",
    ),
    dict(
        name="cuda-batch-fail-index-dropped",
        file="csrc/cuda/cuda_engine.cpp",
        find="                fail_index < static_cast<size_t>(b.count)\n",
        replace="                false\n",
        tests=[FAKE + "::test_a_batch_failure_names_the_descriptor_the_runtime_reports"],
        why="CUDA 12.8/12.9's failIdx is not reported",
    ),
    dict(
        name="fake-cuda-launch-ignores-the-current-device",
        file="tests/fake_cuda/fake_cuda_runtime.cpp",
        find="  if (s->device != t_device) return failed_work(\"cudaLaunchKernel\", s, cudaErrorInvalidResourceHandle);",
        replace="",
        tests=[FAKE + "::test_fake_rule_launches_and_event_records_belong_to_the_current_device"],
        why="a launch on a stream of another device succeeds in the fake",
    ),
    dict(
        name="fake-cuda-event-record-ignores-devices",
        file="tests/fake_cuda/fake_cuda_runtime.cpp",
        find="  if (e->device != s->device) return note(\"cudaEventRecord\", s, cudaErrorInvalidResourceHandle);",
        replace="",
        tests=[FAKE + "::test_fake_rule_launches_and_event_records_belong_to_the_current_device"],
        why="an event records on a stream of another device in the fake",
    ),
    dict(
        name="fake-cuda-invalid-device-accepted",
        file="tests/fake_cuda/fake_cuda_runtime.cpp",
        find="  const cudaError_t err = device < 0 || device >= w.devices ? cudaErrorInvalidDevice\n",
        replace="  const cudaError_t err = false ? cudaErrorInvalidDevice\n",
        tests=[FAKE + "::test_an_invalid_device_is_the_runtimes_error"],
        why="cudaSetDevice of an ordinal that is no device succeeds in the fake",
    ),
    dict(
        name="fake-cuda-batch-in-order",
        file="tests/fake_cuda/fake_cuda_runtime.cpp",
        find="    for (size_t i : batch_order(snap_dst->size())) ",
        replace="    for (size_t i = 0; i < snap_dst->size(); ++i) ",
        tests=[FAKE + "::test_fake_rule_a_batchs_copies_land_in_no_set_order"],
        why="a batch's copies land in the submitted order",
    ),
    dict(
        name="fake-cuda-failed-work-leaves-the-capture-valid",
        file="tests/fake_cuda/fake_cuda_runtime.cpp",
        find="  if (s->capture != nullptr) invalidate(s->capture);\n  return note(api, s, err);",
        replace="  return note(api, s, err);",
        tests=[FAKE + "::test_fake_rule_a_failed_copy_or_launch_invalidates_the_capture"],
        why="a failed copy or launch inside a capture leaves it valid, and the partial graph "
            "instantiates",
    ),
    dict(
        name="cuda-report-claims-the-capture-info-query",
        file="csrc/cuda/cuda_engine.cpp",
        find='"capture_query=cudaStreamIsCapturing (every CUDA release)",',
        replace='"capture_query=cudaStreamGetCaptureInfo (every CUDA release)",',
        tests=[FAKE + "::test_environment_report_says_what_the_engine_uses_on_the_device"],
        why="the report names a query the table does not bind",
    ),
    dict(
        name="cuda-capture-of-large-blocks-per-descriptor",
        file="csrc/core/ops.cpp",
        find="  if (kernel_available && (small || capturing) && mapped().value_or(false)) {",
        replace="  if (kernel_available && (small || (!host_ids && capturing)) && mapped().value_or(false)) {",
        tests=[FAKE + "::test_a_capture_of_many_large_blocks_stays_a_few_graph_nodes"],
        why="issue 25: under capture with host ids and blocks of 32 KiB or more, every "
            "descriptor became its own memcpy node (layers x blocks of them)",
    ),
    dict(
        name="fake-cuda-current-stream-process-wide",
        file="tests/fake_cuda/fake_cuda_runtime.cpp",
        find="  t_streams.set[device] = stream;\n",
        replace="  w.current.at(static_cast<size_t>(device)) = stream;\n",
        tests=[FAKE + "::test_the_current_stream_is_per_thread"],
        why="torch's current stream is per thread (c10/cuda/CUDAStream.cpp); process-wide, a "
            "copy could land on another thread's stream unnoticed",
    ),
]
