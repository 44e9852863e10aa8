"""Mutants of the Ascend engine and of its fake ACL runtime: one per finding
of the engine's review, each reverting its fix (tests/fake_npu/cases_findings.py
holds the case named in each `why`); one per CANN behaviour the engine relies
on (tests/fake_npu/cases_cann.py), reverting the engine's handling of it; and
one per rule of the fake that models it, making the fake kinder than CANN.
tests/test_ascend_fake.py runs the fake-ACL cases, one child session per case
file; a node id runs only its file."""

FAKE = ["tests/test_ascend_fake.py"]
ENGINE = "csrc/ascend/ascend_engine.cpp"
FAKE_ACL = "tests/fake_npu/fake_acl.cpp"


def cann(case: str) -> list[str]:
    """The node id of a case of tests/fake_npu/cases_cann.py."""
    return [f"tests/test_ascend_fake.py::test_fake_npu[main-cases_cann-{case}]"]


MUTANTS = [
    dict(
        name="ascend-batch-api-assumed-present",
        file="csrc/ascend/ascend_engine.cpp",
        where="Engine::submit",
        find="api_.memcpy_batch_async != nullptr && batch_allowed(stream)",
        replace="batch_allowed(stream)",
        tests=FAKE,
        why="finding 1: a CANN without aclrtMemcpyBatchAsync loses every copy "
        "(test_1_engine_copies_without_the_batch_api)",
    ),
    dict(
        name="ascend-207000-not-latched",
        file="csrc/ascend/ascend_engine.cpp",
        where="Engine::copy_batched",
        find="    if (err == kAclFeatureNotSupported && probing) {\n",
        replace="    if (false) {\n",
        tests=FAKE,
        why="finding 2: 207000 from the batch API fails the copy instead of taking the "
        "per-descriptor path (test_2_batch_207000_latches_the_per_descriptor_path_once_per_device)",
    ),
    dict(
        name="ascend-capture-query-failure-throws",
        file="csrc/ascend/ascend_engine.cpp",
        where="Engine::capture_state",
        find="  if (err == kAclFeatureNotSupported) return Capture::kNone;\n",
        replace="  if (err == kAclFeatureNotSupported) return Capture::kNone;\n"
        "  TORCH_CHECK(false, \"aclmdlRICaptureGetInfo failed: \", acl_message(err));\n",
        tests=FAKE,
        why="finding 2: a failing capture query fails every host<->device copy "
        "(test_2_failing_capture_query_takes_the_per_descriptor_path)",
    ),
    dict(
        name="ascend-register-maps-instead-of-pinning",
        file="csrc/ascend/ascend_engine.cpp",
        where="Engine::host_register",
        find="api_.host_register_v2(ptr, bytes, kHostRegPinned)",
        replace="api_.host_register_v2(ptr, bytes, 0x2u /* ACL_HOST_REG_MAPPED */)",
        tests=FAKE,
        why="finding 3: mapped host memory is not page-locked (test_3_host_register_page_locks_in_place)",
    ),
    dict(
        name="ascend-pageable-host-caches-accepted",
        file="csrc/core/ops.cpp",
        where="swap_blocks",
        find="    if (accelerator && d.count > 0) check_host_caches_pinned(src_caches, dst_caches, route.device);\n",
        replace="",
        tests=FAKE,
        why="finding 4: pageable host caches reach CANN (test_4_tensor_op_refuses_pageable_host_caches)",
    ),
    dict(
        name="ascend-null-stream-accepted",
        file="csrc/ascend/ascend_engine.cpp",
        where="Engine::current_stream",
        find="TORCH_CHECK(handle != nullptr,",
        replace="TORCH_CHECK(true || handle != nullptr,",
        tests=FAKE,
        why="finding 5: a null stream sends the copies to the default stream (test_5_null_stream_is_refused)",
    ),
    dict(
        name="ascend-attrs-per-descriptor",
        file="csrc/ascend/ascend_engine.cpp",
        where="Engine::copy_batched",
        find="        &attr, &attr_index, 1, &fail_index, stream);",
        replace="        std::vector<MemcpyBatchAttr>(n, attr).data(),\n"
        "        [n] { std::vector<size_t> i(n); for (size_t k = 0; k < n; ++k) i[k] = k; return i; }().data(),\n"
        "        n + 0 * attr_index, &fail_index, stream);",
        tests=FAKE,
        why="finding 6: one attrs entry per descriptor instead of one with index 0 "
        "(test_6_batch_passes_one_attrs_entry)",
    ),
    dict(
        name="ascend-descriptor-table-held-after-submit",
        file="csrc/ascend/ascend_engine.cpp",
        where="submit_kernel",
        find="void submit_kernel(const CopyBatch& batch, c10::Device device) { engine().submit(batch, device); }",
        replace="void submit_kernel(const CopyBatch& batch, c10::Device device) {\n"
        "  static at::Tensor held;  // kept until the next call, as an in-flight record would\n"
        "  engine().submit(batch, device);\n"
        "  held = batch.owner;\n"
        "}",
        tests=FAKE,
        why="finding 7: the descriptor arrays are held after the call "
        "(test_7_descriptor_table_is_released_when_submit_returns)",
    ),
    dict(
        name="ascend-batch-not-split",
        file="csrc/ascend/ascend_engine.h",
        find="constexpr size_t kMaxBatchEntries = 4096;",
        replace="constexpr size_t kMaxBatchEntries = size_t{1} << 40;",
        tests=FAKE,
        why="finding 8: batches over CANN's 4096-entry cap (test_8_batches_over_4096_entries_are_split)",
    ),
    dict(
        name="ascend-stream-capturing-not-served",
        file="csrc/ascend/ascend_engine.cpp",
        where="engine_interface",
        find="      /*stream_capturing=*/&stream_capturing_kernel,\n",
        replace="      /*stream_capturing=*/nullptr,\n",
        tests=FAKE,
        why="finding 9: device-resident ids are read back during capture "
        "(test_9_device_ids_under_capture_are_refused)",
    ),
    dict(
        name="ascend-capture-capacity-unchecked",
        file="csrc/ascend/ascend_engine.cpp",
        where="Engine::submit",
        find="TORCH_CHECK(capture != Capture::kActive || b.count <= kMaxCapturedCopies,",
        replace="TORCH_CHECK(capture == capture || b.count <= kMaxCapturedCopies,",
        tests=FAKE,
        why="finding 9: a capture past the task capacity fails midway (EE1023) "
        "(test_9_capture_over_the_task_capacity_is_refused)",
    ),
    dict(
        name="ascend-error-hides-queued-copies",
        file="csrc/ascend/ascend_engine.cpp",
        where="Engine::copy_each",
        find="format_descriptor(b, i), \": \", acl_message(err), \"; \", left_behind(i, i + 1));",
        replace="format_descriptor(b, i), \": \", acl_message(err));",
        tests=FAKE,
        why="finding 10: the error does not say copies 0..i-1 were queued "
        "(test_10_error_names_the_copies_already_queued)",
    ),
    dict(
        name="ascend-pinned-use-not-recorded",
        file="csrc/core/ops.cpp",
        where="swap_blocks",
        find="  if (accelerator) record_host_use(src_caches, dst_caches, route.device);\n",
        replace="  if (route.device.is_cuda()) record_host_use(src_caches, dst_caches, route.device);\n",
        tests=FAKE,
        why="finding 11: a pinned tensor freed after the call is reused mid-copy "
        "(test_11_pinned_tensor_freed_after_the_call_is_not_reused_mid_copy)",
    ),
    dict(
        name="ascend-d2d-alignment-unchecked",
        file="csrc/ascend/ascend_engine.cpp",
        where="Engine::submit",
        find="  if (b.direction == Direction::kDeviceToDevice) check_device_to_device_alignment(b);\n",
        replace="  if (b.direction == Direction::kDeviceToDevice && b.count < 0) check_device_to_device_alignment(b);\n",
        tests=FAKE,
        why="finding 12: unaligned device-to-device copies are queued "
        "(test_12_unaligned_device_to_device_copy_is_refused_before_queuing)",
    ),
    # --- CANN's own behaviour, as the engine handles it -------------------------------------------
    dict(
        name="ascend-207000-latch-device-wide",
        file=ENGINE,
        where="Engine::batch_allowed",
        find="  auto it = batch_states_.find(stream);\n  if (it == batch_states_.end() || it->second.state",
        replace="  auto it = batch_states_.empty() ? batch_states_.end() : batch_states_.begin();\n"
        "  if (it == batch_states_.end() || it->second.state",
        tests=[
            "tests/test_ascend_fake.py::test_fake_npu[main-cases_findings-"
            "test_2_batch_207000_latches_the_per_descriptor_path_once_per_device]",
            *cann("test_a_refused_first_batch_latches_and_copies_per_descriptor"),
        ],
        why="a refusal for one stream must not latch the others",
    ),
    dict(
        name="ascend-207000-reissued-from-descriptor-0",
        file=ENGINE,
        where="Engine::copy_batched",
        find="    if (err == kAclFeatureNotSupported && probing) {\n",
        replace="    if (err == kAclFeatureNotSupported) {\n",
        tests=cann("test_207000_for_a_later_batch_of_a_call_is_not_reissued_from_descriptor_0"),
        why="a 207000 after queued batches re-issues copies 0..4095, already queued",
    ),
    dict(
        name="ascend-first-batch-not-one-entry",
        file=ENGINE,
        where="Engine::copy_batched",
        find="        probing ? 1 : std::min(kMaxBatchEntries",
        replace="        false ? 1 : std::min(kMaxBatchEntries",
        tests=cann("test_207000_for_a_whole_batch_on_the_first_call_reissues_nothing_twice"),
        why="CANN's loop queues entries 0..n-2 and answers 207000: latching then re-issues them",
    ),
    dict(
        name="ascend-ambiguous-207000-not-asked-again",
        file=ENGINE,
        where="Engine::copy_batched",
        find="    if (err == kAclFeatureNotSupported) set_batch_state(stream, BatchState::kUntried);\n",
        replace="",
        tests=cann("test_207000_after_the_stream_took_batches_fails_and_reissues_nothing"),
        why="after an ambiguous 207000 the stream's next batch must be one entry again",
    ),
    dict(
        name="ascend-batch-error-without-index-claims-nothing-queued",
        file=ENGINE,
        where="Engine::copy_batched",
        find="left_behind(first, known ? failed : first + static_cast<int64_t>(n))",
        replace="left_behind(first, known ? failed : first)",
        tests=cann("test_batch_error_without_a_failing_index_says_the_batch_may_be_queued"),
        why="without a failing index CANN may have queued part of the batch "
        "(api_impl.cc:8932-8935, api_impl_david.cc:863-867)",
    ),
    dict(
        name="ascend-batch-error-with-index-hides-queued-prefix",
        file=ENGINE,
        where="Engine::copy_batched",
        find="left_behind(first, known ? failed : first + static_cast<int64_t>(n))",
        replace="left_behind(first, known ? first : first + static_cast<int64_t>(n))",
        tests=cann("test_batch_error_with_a_failing_index_never_says_nothing_was_queued"),
        why="CANN's loop queues the entries before the failing index (api_impl.cc:8905-8910)",
    ),
    dict(
        name="ascend-copy-error-claims-failed-copy-not-queued",
        file=ENGINE,
        where="Engine::copy_each",
        find="left_behind(i, i + 1));",
        replace="left_behind(i, i));",
        tests=cann("test_per_descriptor_error_says_the_failed_copy_may_be_partly_queued"),
        why="CANN splits a large copy into tasks (api_impl_david.cc:941-950): a failed copy "
        "may be queued in part",
    ),
    dict(
        name="ascend-pin-not-verified",
        file=ENGINE,
        where="Engine::host_register",
        find="  if (!registered_host(ptr, bytes)) {\n",
        replace="  if (false) {\n",
        tests=cann("test_registration_the_query_does_not_confirm_is_undone"),
        why="a registration that did nothing leaves the mirrors pageable",
    ),
    dict(
        name="ascend-pin-verified-at-its-start-only",
        file=ENGINE,
        where="Engine::registered_host",
        find="  for (const uintptr_t at : {start, start + bytes - 1}) {\n",
        replace="  for (const uintptr_t at : {start}) {\n",
        tests=cann("test_registration_is_checked_at_both_ends"),
        why="the query must cover the registered range's last byte too",
    ),
    dict(
        name="ascend-pin-query-error-ignored",
        file=ENGINE,
        where="Engine::registered_host",
        find="    if (err != kAclSuccess || attributes.location.type != MemLocationType::kHost) return false;\n",
        replace="    if (attributes.location.type != MemLocationType::kHost) return false;\n",
        tests=cann("test_registration_is_checked_at_both_ends"),
        why="a failed query leaves zeroed attributes, which read as HOST",
    ),
    dict(
        name="ascend-pinned-tensor-checked-at-its-start-only",
        file=ENGINE,
        where="Engine::host_pinned",
        find="isPinnedPtr(reinterpret_cast<const void*>(hi - 1),",
        replace="isPinnedPtr(reinterpret_cast<const void*>(lo),",
        tests=cann("test_memory_registered_by_someone_else_is_judged_by_the_runtime_at_both_ends"),
        why="a tensor straddling the end of a pinned range was accepted",
    ),
    dict(
        name="ascend-capture-bound-strict",
        file=ENGINE,
        where="Engine::submit",
        find="b.count <= kMaxCapturedCopies,",
        replace="b.count < kMaxCapturedCopies,",
        tests=cann("test_capture_of_exactly_32768_copies_is_allowed"),
        why="32768 one-entry copies fit a captured stream (stream_jetty_context.cc:62)",
    ),
    dict(
        name="ascend-shutdown-raises-on-unregister-failure",
        file="torch_kvswap/offloader/host_memory.py",
        where="unregister_chunks",
        find="        except (NotImplementedError, RuntimeError) as exc:\n",
        replace="        except NotImplementedError as exc:\n",
        tests=cann("test_shutdown_survives_an_unregister_failure"),
        why="shutdown() raised when aclrtHostUnregister failed and released nothing after it",
    ),
    dict(
        name="ascend-shutdown-frees-still-registered-memory",
        file="torch_kvswap/offloader/host_memory.py",
        where="unregister_chunks",
        find="            STILL_REGISTERED.append(buffer)\n",
        replace="            pass\n",
        tests=cann("test_shutdown_survives_an_unregister_failure"),
        why="memory CANN still counts as registered went back to the allocator",
    ),
    # --- the fake's rules, made kinder than CANN ----------------------------------------------------
    dict(
        name="fake-acl-loop-queues-nothing-before-a-failed-check",
        file=FAKE_ACL,
        where="batch_loop",
        find="      *fail_index = i;\n      if (AclError q = queue_unordered(s, queued)) return q;\n      return e;\n",
        replace="      *fail_index = i;\n      return e;\n",
        tests=cann("test_loop_route_queues_the_entries_before_a_failed_check"),
        why="api_impl.cc:8905-8910 queues the entries before the failing one",
    ),
    dict(
        name="fake-acl-loop-stops-at-207000",
        file=FAKE_ACL,
        where="batch_loop",
        find="    if (last == ascend::kAclFeatureNotSupported) continue;\n",
        replace="",
        tests=cann("test_loop_route_goes_past_207000_and_answers_with_the_last_code"),
        why="api_impl.cc:8932-8938 goes past DRV_NOT_SUPPORT and answers with the last code",
    ),
    dict(
        name="fake-acl-ub-route-in-one-chunk",
        file=FAKE_ACL,
        where="batch_ub",
        find="  const size_t chunk = rt().ub_chunk == 0 ? n : rt().ub_chunk;\n",
        replace="  const size_t chunk = n;\n",
        tests=cann("test_ub_route_chunk_failure_leaves_the_earlier_chunks_copied"),
        why="api_impl_david.cc:863-876 fails a later chunk with the earlier ones queued",
    ),
    dict(
        name="fake-acl-no-per-stream-refusal",
        file=FAKE_ACL,
        where="memcpy_batch_async",
        find="  if (rt().batch_refused_streams.count({s->device, s->id}) != 0 && rt().capturing(s)) {\n",
        replace="  if (false) {\n",
        tests=cann("test_refusals_for_a_device_and_for_one_stream"),
        why="api_error.cc:7382-7384 refuses one stream with 207000",
    ),
    dict(
        name="fake-acl-sub-graph-stream-takes-copies",
        file=FAKE_ACL,
        where="memcpy_async",
        find="  if (rt().batch_refused_streams.count({s->device, s->id}) != 0 && rt().capturing(s) &&\n",
        replace="  if (false &&\n",
        tests=cann("test_refusals_for_a_device_and_for_one_stream"),
        why="api_error.cc:2253-2255 refuses host<->device aclrtMemcpyAsync on a stream in a sub-graph capture",
    ),
    dict(
        name="fake-acl-no-device-refusal",
        file=FAKE_ACL,
        where="memcpy_batch_async",
        find="  if (rt().batch_refused_devices.count(s->device) != 0) {\n",
        replace="  if (false) {\n",
        tests=cann("test_a_refused_first_batch_latches_and_copies_per_descriptor"),
        why="api_c_memory.cc:780-783 and api_impl.cc:8950-8953 refuse a whole device",
    ),
    dict(
        name="fake-acl-pin-always-locks",
        file=FAKE_ACL,
        where="host_register_v2",
        find="rt().pin_records_only ? Kind::kRecorded : Kind::kPinned;",
        replace="Kind::kPinned;",
        tests=cann("test_a_pin_without_the_driver_feature_only_records"),
        why="api_impl.cc:2589-2609: without the driver feature PINNED only records the range",
    ),
    dict(
        name="fake-acl-recorded-pin-reported-unregistered",
        file=FAKE_ACL,
        where="location_of",
        find="    case Kind::kMapped:\n    case Kind::kRecorded:\n      return MemLocationType::kHost;\n",
        replace="    case Kind::kMapped:\n      return MemLocationType::kHost;\n    case Kind::kRecorded:\n"
        "      return MemLocationType::kUnregistered;\n",
        tests=cann("test_a_pin_without_the_driver_feature_only_records"),
        why="npu_driver_mem.cc:2073-2074 reports a recorded range as HOST: the engine cannot tell",
    ),
    dict(
        name="fake-acl-batch-in-submitted-order",
        file=FAKE_ACL,
        where="queue_unordered",
        find="  for (size_t i : scrambled(copies.size())) {\n",
        replace="  for (size_t i = 0; i < copies.size(); ++i) {\n",
        tests=cann("test_a_batch_runs_in_a_scrambled_order"),
        why="CANN documents batch copies as unordered; an in-order fake hides ordering assumptions",
    ),
    dict(
        name="fake-acl-ee1023-code",
        file=FAKE_ACL,
        find="constexpr AclError kRtNoStreamResource = 207008;",
        replace="constexpr AclError kRtNoStreamResource = 207005;",
        tests=cann("test_capture_limit_counts_work_entries_and_answers_207008"),
        why="RT_ERROR_JETTY_LIMIT is 207008 (errcode_manage.cc:96)",
    ),
    dict(
        name="fake-acl-work-entries-are-copies",
        file=FAKE_ACL,
        where="Runtime::record_into_graph",
        find="  const uint64_t need = work_entry_bytes == 0 ? 1 :",
        replace="  const uint64_t need = true ? 1 :",
        tests=cann("test_capture_limit_counts_work_entries_and_answers_207008"),
        why="stream_jetty_handler.cc:133 counts work entries, not copies",
    ),
    dict(
        name="fake-acl-4096-cap-on-every-route",
        file=FAKE_ACL,
        where="memcpy_batch_async",
        find="  Stream* s = resolve(handle);\n  // A chip without the feature",
        replace="  if (n > kMaxBatchCount) return rt().error(kRtParamInvalid, \"cap\");\n"
        "  Stream* s = resolve(handle);\n  // A chip without the feature",
        tests=cann("test_only_the_ub_pageable_route_caps_a_batch_at_4096"),
        why="the async check has no cap (api_error.cc:7344-7386)",
    ),
    dict(
        name="fake-acl-ub-pageable-uncapped",
        file=FAKE_ACL,
        where="batch_ub",
        find="    if (n > kMaxBatchCount) {\n",
        replace="    if (false) {\n",
        tests=cann("test_only_the_ub_pageable_route_caps_a_batch_at_4096"),
        why="the driver refuses more than 4096 entries with DRV_ERROR_NOT_SUPPORT "
        "(ascend_hal_base.h:2105), 207000 (api_c_memory.cc:791)",
    ),
    dict(
        name="fake-acl-unregister-code",
        file=FAKE_ACL,
        find="constexpr AclError kHostMemoryNotRegistered = 507911;",
        replace="constexpr AclError kHostMemoryNotRegistered = 107000;",
        tests=cann("test_register_twice_and_unregister_unknown_memory"),
        why="RT_ERROR_HOST_MEMORY_NOT_REGISTERED is 507911 (errcode_manage.cc:555-556)",
    ),
    dict(
        name="fake-acl-overlapping-registration-accepted-as-other-error",
        file=FAKE_ACL,
        where="host_register_v2",
        find="    if (r.in_place) {\n",
        replace="    if (false) {\n",
        tests=cann("test_register_twice_and_unregister_unknown_memory"),
        why="register_memory.cc:61-76: an overlapping range is EE1018, 507910",
    ),
    dict(
        name="fake-acl-event-freed-while-its-record-is-queued",
        file="tests/fake_npu/fake_backend.cpp",
        where="FakeGuardImpl::destroyEvent",
        find="    if (e->queued_records > 0) {\n",
        replace="    if (false) {\n",
        tests=[
            "tests/test_ascend_fake.py::test_fake_npu[main-cases_fake_rules-"
            "test_an_event_destroyed_before_its_record_ran_is_freed_when_it_runs]"
        ],
        why="aclrtDestroyEvent before the event completes frees it when it completes "
        "(CANN 8.0 aclcppdevg_03_0082); freeing it at once made Stream.wait_stream's "
        "queued record write freed memory, a crash on some machines",
    ),
    dict(
        name="ascend-partly-registered-tensor-asks-the-ends",
        file=ENGINE,
        where="Engine::host_pinned",
        find="    case Coverage::kPartial:\n      return false;\n",
        replace="    case Coverage::kPartial:\n      break;\n",
        tests=cann("test_a_gap_between_two_registrations_is_not_pinned_and_adjacent_ones_are"),
        why="issue 25: a pageable gap between two registrations was accepted, since the "
        "runtime answers HOST at both ends; CANN judges a copy by its start address "
        "(api_impl.cc:8799, :8814)",
    ),
    dict(
        name="ascend-registered-tensor-without-the-runtimes-opinion",
        file=ENGINE,
        where="Engine::host_pinned",
        find="        return registered_host(reinterpret_cast<void*>(start), 1);\n",
        replace="        return start != 0;\n",
        tests=cann("test_a_registration_the_runtime_no_longer_reports_is_not_pinned"),
        why="the engine's table alone would call memory pinned that the runtime does not",
    ),
    dict(
        name="ascend-undo-failure-reads-as-nothing-registered",
        file=ENGINE,
        where="Engine::host_register",
        find="        : undo == kAclHostMemoryNotRegistered\n",
        replace="        : true\n",
        tests=cann("test_a_registration_that_can_be_neither_confirmed_nor_undone_is_never_freed"),
        why="issue 25: a registration neither confirmed nor undone was reported like one that "
        "registered nothing, and the offloader freed memory CANN still had registered",
    ),
    dict(
        name="ascend-submit-without-device-guard",
        file=ENGINE,
        where="Engine::submit",
        find="              \"kvswap Ascend engine asked to copy on \", device);\n  c10::DeviceGuard guard(device);\n",
        replace="              \"kvswap Ascend engine asked to copy on \", device);\n",
        tests=[
            "tests/test_ascend_fake.py::test_fake_npu[main-cases_paths-"
            "test_batch_path_names_the_device_of_the_copy]"
        ],
        why="issue 25 (a revert that survived): without the guard, a copy for npu:1 runs with "
        "npu:0 current, and CANN refuses npu:1's stream there (107003, api_impl.cc:2882-2883)",
    ),
    dict(
        name="fake-acl-stream-of-another-context-accepted",
        file=FAKE_ACL,
        where="check_context",
        find="  if (s->device == current) return 0;\n",
        replace="  if (true) return 0;\n",
        tests=[
            "tests/test_ascend_fake.py::test_fake_npu[main-cases_fake_rules-"
            "test_a_copy_on_a_stream_of_another_device_is_refused]"
        ],
        why="ACL_ERROR_RT_STREAM_CONTEXT (rt_error_codes.h:24): a stream of another context is "
        "refused (api_impl.cc:2882-2883, api_impl_david.cc:818-820, :924-925)",
    ),
    dict(
        name="ascend-refused-stream-never-probed-again",
        file=ENGINE,
        where="Engine::batch_allowed",
        find="  if (--it->second.until_probe > 0) return false;\n",
        replace="  return false;\n",
        tests=cann("test_a_refused_stream_is_probed_again_with_backoff"),
        why="issue 25: a refused one-entry probe latched the stream for good, though the "
        "refusal may have been the entry's memory",
    ),
    dict(
        name="ascend-reprobe-without-backoff",
        file=ENGINE,
        where="Engine::set_batch_state",
        find="    const uint64_t shift = std::min<uint64_t>(s.refusals, 10);\n",
        replace="    const uint64_t shift = 0;\n",
        tests=cann("test_a_stream_that_keeps_refusing_is_probed_ever_less_often"),
        why="a stream that always refuses must cost ever fewer refused probes",
    ),
    dict(
        name="fake-acl-clobbers-the-arrays-of-a-failed-batch",
        file=FAKE_ACL,
        where="memcpy_batch_async",
        find="  if (err != 0) return err;\n  for (size_t i = 0; i < n; ++i) {\n",
        replace="  for (size_t i = 0; i < n; ++i) {\n",
        tests=cann("test_batch_error_at_the_first_entry_of_a_later_part_names_only_the_queued_parts"),
        why="CANN reads or copies the arrays and never writes them (api_impl.cc:8887-8939, "
        "api_impl_david.cc:860-862); clobbered on failure, error texts printed 0xdead0000",
    ),
    dict(
        name="fake-acl-jetty-limit-on-every-chip",
        file=FAKE_ACL,
        where="Runtime::record_into_graph",
        find="  if (batch_route == BatchRoute::kUb && entries + need > kGraphWorkEntries) {\n",
        replace="  if (entries + need > kGraphWorkEntries) {\n",
        tests=cann("test_only_ub_chips_cap_a_captured_stream_at_32768_work_entries"),
        why="the jetty limit is the UB (v200) chips' only (memory_task_v200_base.cc:260, :839)",
    ),
    dict(
        name="fake-acl-sub-graph-refusal-outside-capture",
        file=FAKE_ACL,
        where="memcpy_batch_async",
        find="  if (rt().batch_refused_streams.count({s->device, s->id}) != 0 && rt().capturing(s)) {\n",
        replace="  if (rt().batch_refused_streams.count({s->device, s->id}) != 0) {\n",
        tests=cann("test_refusals_for_a_device_and_for_one_stream"),
        why="CANN refuses only a stream bound to a sub-graph capture (api_error.cc:7382-7384, "
        "capture_model_utils.cc:421-441)",
    ),
    dict(
        name="ascend-batch-cap-one-over",
        file="csrc/ascend/ascend_engine.h",
        find="constexpr size_t kMaxBatchEntries = 4096;",
        replace="constexpr size_t kMaxBatchEntries = 4097;",
        tests=[
            "tests/test_ascend_fake.py::test_fake_npu[main-cases_findings-"
            "test_8_a_call_is_split_at_the_4096_entry_cap]"
        ],
        why="issue 36 item 4: a batch of 4097 entries on CANN's UB route with pageable memory is refused (207000)",
    ),
    dict(
        name="ascend-batch-cap-one-under",
        file="csrc/ascend/ascend_engine.h",
        find="constexpr size_t kMaxBatchEntries = 4096;",
        replace="constexpr size_t kMaxBatchEntries = 4095;",
        tests=[
            "tests/test_ascend_fake.py::test_fake_npu[main-cases_findings-"
            "test_8_a_call_is_split_at_the_4096_entry_cap]"
        ],
        why="issue 36 item 4: 4096 entries, the cap itself, go in one call",
    ),
]
