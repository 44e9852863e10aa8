"""Mutants of the Ascend engine: one per finding of the engine's review, each
reverting its fix. tests/test_ascend_fake.py runs the fake-ACL cases
(tests/fake_npu/cases_findings.py holds the case named in each `why`)."""

FAKE = ["tests/test_ascend_fake.py"]

MUTANTS = [
    dict(
        name="ascend-batch-api-assumed-present",
        file="csrc/ascend/ascend_engine.cpp",
        find="api_.memcpy_batch_async != nullptr && !batch_unsupported(device.index())",
        replace="!batch_unsupported(device.index())",
        tests=FAKE,
        why="finding 1: a CANN without aclrtMemcpyBatchAsync loses every copy "
            "(test_1_engine_copies_without_the_batch_api)",
    ),
    dict(
        name="ascend-207000-not-latched",
        file="csrc/ascend/ascend_engine.cpp",
        find="    if (err == kAclFeatureNotSupported) {\n",
        replace="    if (false) {\n",
        tests=FAKE,
        why="finding 2: 207000 from the batch API fails the copy instead of taking the "
            "per-descriptor path (test_2_batch_207000_latches_the_per_descriptor_path_once_per_device)",
    ),
    dict(
        name="ascend-capture-query-failure-throws",
        file="csrc/ascend/ascend_engine.cpp",
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
        find="api_.host_register_v2(ptr, bytes, kHostRegPinned)",
        replace="api_.host_register_v2(ptr, bytes, 0x2u /* ACL_HOST_REG_MAPPED */)",
        tests=FAKE,
        why="finding 3: mapped host memory is not page-locked (test_3_host_register_page_locks_in_place)",
    ),
    dict(
        name="ascend-pageable-host-caches-accepted",
        file="csrc/core/routing.cpp",
        find="  if (ascend) check_host_caches_pinned(src_caches, dst_caches, route.device);\n",
        replace="",
        tests=FAKE,
        why="finding 4: pageable host caches reach CANN (test_4_tensor_op_refuses_pageable_host_caches)",
    ),
    dict(
        name="ascend-null-stream-accepted",
        file="csrc/ascend/ascend_engine.cpp",
        find="TORCH_CHECK(handle != nullptr,",
        replace="TORCH_CHECK(true || handle != nullptr,",
        tests=FAKE,
        why="finding 5: a null stream sends the copies to the default stream (test_5_null_stream_is_refused)",
    ),
    dict(
        name="ascend-attrs-per-descriptor",
        file="csrc/ascend/ascend_engine.cpp",
        find="        &attr, &attr_index, 1, &fail_index, stream);",
        replace="        BatchAttrs<MemcpyBatchAttr>::per_descriptor(static_cast<int64_t>(n), attr)->attrs.data(),\n"
                "        BatchAttrs<MemcpyBatchAttr>::per_descriptor(static_cast<int64_t>(n), attr)->indexes.data(),\n"
                "        n + 0 * attr_index, &fail_index, stream);",
        tests=FAKE,
        why="finding 6: one attrs entry per descriptor instead of one with index 0 "
            "(test_6_batch_passes_one_attrs_entry)",
    ),
    dict(
        name="ascend-descriptor-table-held-after-submit",
        file="csrc/ascend/ascend_engine.cpp",
        find="  engine().submit(batch_from_tensors(src_ptrs, dst_ptrs, sizes, direction, total_bytes), device);\n",
        replace="  static std::vector<at::Tensor> held;  // kept until the next call, as an in-flight record would\n"
                "  engine().submit(batch_from_tensors(src_ptrs, dst_ptrs, sizes, direction, total_bytes), device);\n"
                "  held = {src_ptrs, dst_ptrs, sizes};\n",
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
        find="  m.impl(\"_stream_capturing\", &kvswap::ascend::stream_capturing_kernel);\n",
        replace="",
        tests=FAKE,
        why="finding 9: device-resident ids are read back during capture "
            "(test_9_device_ids_under_capture_are_refused)",
    ),
    dict(
        name="ascend-capture-capacity-unchecked",
        file="csrc/ascend/ascend_engine.cpp",
        find="TORCH_CHECK(capture != Capture::kActive || b.count <= kMaxCapturedCopies,",
        replace="TORCH_CHECK(capture == capture || b.count <= kMaxCapturedCopies,",
        tests=FAKE,
        why="finding 9: a capture past the task capacity fails midway (EE1023) "
            "(test_9_capture_over_the_task_capacity_is_refused)",
    ),
    dict(
        name="ascend-error-hides-queued-copies",
        file="csrc/ascend/ascend_engine.cpp",
        find="describe_descriptor(b, i), \": \", acl_message(err), \"; \", queued_before(i));",
        replace="describe_descriptor(b, i), \": \", acl_message(err));",
        tests=FAKE,
        why="finding 10: the error does not say copies 0..i-1 were queued "
            "(test_10_error_names_the_copies_already_queued)",
    ),
    dict(
        name="ascend-pinned-use-not-recorded",
        file="csrc/core/routing.cpp",
        find="  if (ascend) record_host_use(src_caches, dst_caches, route.device);\n",
        replace="",
        tests=FAKE,
        why="finding 11: a pinned tensor freed after the call is reused mid-copy "
            "(test_11_pinned_tensor_freed_after_the_call_is_not_reused_mid_copy)",
    ),
    dict(
        name="ascend-d2d-alignment-unchecked",
        file="csrc/ascend/ascend_engine.cpp",
        find="  if (b.direction == Direction::kDeviceToDevice) check_device_to_device_alignment(b);\n",
        replace="  if (b.direction == Direction::kDeviceToDevice && b.count < 0) check_device_to_device_alignment(b);\n",
        tests=FAKE,
        why="finding 12: unaligned device-to-device copies are queued "
            "(test_12_unaligned_device_to_device_copy_is_refused_before_queuing)",
    ),
]
