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
        find="&args->attr, &args->index, 1, stream);",
        replace="BatchAttrs<cudaMemcpyAttributes>::per_descriptor(b.count, args->attr)->attrs.data(),\n"
                "BatchAttrs<cudaMemcpyAttributes>::per_descriptor(b.count, args->attr)->indexes.data(),\n"
                "static_cast<size_t>(b.count), stream);",
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
        find="    if (std::find(seen.begin(), seen.end(), base) != seen.end()) continue;\n",
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
        file="csrc/core/routing.cpp",
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
        file="csrc/core/routing.cpp",
        find="(small || (!host_ids && capturing))",
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
]
