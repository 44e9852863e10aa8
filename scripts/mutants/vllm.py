"""Mutants of torch_kvswap/integrations/vllm/ (data for scripts/mutation_check.py).

Their tests run in .venv, without vLLM: the copy backend is driven by the calls
vLLM's worker makes, and the offloading plug-in is built on a stand-in of
vLLM's interface (tests/test_vllm_import.py). The tests in vLLM's own
environments (scripts/test_vllm.sh) cover the same code against the real thing.
"""

_BACKEND = "torch_kvswap/integrations/vllm/copy_backend.py"
_OFF = "torch_kvswap/integrations/vllm/offloading.py"
_SPEC = "torch_kvswap/integrations/vllm/offloading_spec.py"
_TIERING = "torch_kvswap/integrations/vllm/tiering_spec.py"
_LAYOUTS = "torch_kvswap/integrations/vllm/host_layouts.py"
_SIMPLE = "torch_kvswap/integrations/vllm/simple_offload.py"
_HANDLER = "torch_kvswap/integrations/vllm/offloading_handler.py"
_COMPAT = "torch_kvswap/integrations/vllm/compat.py"
# One test each (node ids): the CI's --fast pass runs every mutant.
_B = "tests/test_vllm_copy_backend.py::"
_I = "tests/test_vllm_import.py::"
# vLLM 0.23's handler, on the stand-in of its worker interface (the [vllm]
# twins run in .venv-vllm-0.23).
_H = "tests/test_vllm023_worker.py::"

MUTANTS = [
    dict(
        name="vllm-backend-host-wait-event-ignored",
        file=_BACKEND,
        find="                if wait_event is not None:\n                    wait_event.synchronize()\n",
        replace="",
        tests=[_B + "test_a_store_waits_for_its_wait_event_before_it_copies"],
        why="a store must not read the KV cache before its compute-done event (wait_event)",
    ),
    dict(
        name="vllm-backend-stream-wait-event-ignored",
        file=_BACKEND,
        find="                    if wait_event is not None:\n                        stream.wait_event(wait_event)\n",
        replace="",
        tests=[_B + "test_the_stream_path_waits_then_copies_then_records_inside_the_stream"],
        why="on an accelerator the copy stream must wait for wait_event before the copy",
    ),
    dict(
        name="vllm-backend-stream-event-not-listed",
        file=_BACKEND,
        find="        events_list.append((event_idx, event))\n",
        replace="",
        tests=[_B + "test_the_stream_path_waits_then_copies_then_records_inside_the_stream"],
        why="vLLM's worker polls events_list: a launch whose event is missing never completes",
    ),
    dict(
        name="vllm-backend-failure-not-named",
        file=_BACKEND,
        find="        except Exception as exc:\n",
        replace="        except ImportError as exc:\n",
        tests=[_B + "test_a_failed_copy_raises_from_launch_copy_naming_event_blocks_and_cause"],
        why="a failed copy must raise CopyFailed naming the event, the blocks and the cause",
    ),
    dict(
        name="vllm-backend-shutdown-does-not-wait",
        file=_BACKEND,
        find="        for stream in self._streams.values():\n            stream.synchronize()\n",
        replace="",
        tests=[_B + "test_the_stream_path_waits_then_copies_then_records_inside_the_stream"],
        why="shutdown must let the copies in flight finish before the mirrors are released",
    ),
    dict(
        name="vllm-backend-shutdown-not-idempotent",
        file=_BACKEND,
        find="        if self._closed:\n            return\n        self._closed = True\n",
        replace="        self._closed = True\n",
        tests=[_B + "test_the_stream_path_waits_then_copies_then_records_inside_the_stream"],
        why="a second shutdown must do nothing (vLLM and the connector may both call it)",
    ),
    dict(
        name="vllm-backend-launch-after-shutdown",
        file=_BACKEND,
        find="        if not self._initialized or self._closed:",
        replace="        if not self._initialized:",
        tests=[_B + "test_shutdown_is_idempotent_and_refuses_later_launches"],
        why="a launch after shutdown must raise, not queue on a stopped copy thread",
    ),
    dict(
        name="vllm-regions-kv-halves-overlap",
        file="torch_kvswap/integrations/vllm/simple_offload.py",
        find="int(kt.offset) + l * int(kt.layer_stride) + i * span)",
        replace="int(kt.offset) + l * int(kt.layer_stride) + i * stride)",
        tests=[_B + "test_a_layer_with_k_and_v_halves_outermost_gives_two_regions"],
        why="the regions inside one layer's span (K and V halves) start a whole block span apart",
    ),
    dict(
        name="vllm-regions-overlays-twice",
        file="torch_kvswap/integrations/vllm/simple_offload.py",
        find="            if region.data_ptr() in seen:\n                continue\n",
        replace="",
        tests=[_B + "test_layers_sharing_one_allocation_and_overlaid_groups_give_each_region_once"],
        why="groups that overlay one allocation must give its regions once (else copied twice)",
    ),
    dict(
        name="vllm-regions-block-outermost-offset",
        file="torch_kvswap/integrations/vllm/simple_offload.py",
        find="int(kt.offset) - int(kt.offset) % stride)]",
        replace="int(kt.offset))]",
        tests=[_B + "test_block_outermost_packing_gives_one_region_of_packed_blocks"],
        why="a packed block starts at a multiple of block_stride, not at a layer's offset in it",
    ),
    dict(
        name="vllm-failed-job-reported-as-success",
        file=_SPEC,
        find="            if not r.success:\n",
        replace="            if False:\n",
        tests=[_I + "test_a_failed_store_raises_from_get_finished_naming_job_copy_and_cause"],
        why="vLLM only asserts success (gone under python -O): the worker must raise for a failed job",
    ),
    dict(
        name="vllm-canonical-layout-accepted",
        file=_OFF,
        find='    if getattr(config, "canonical_layout", False) or extra.get("canonical_layout"):\n',
        replace='    if extra.get("canonical_layout"):\n',
        tests=[_I + "test_the_spec_refuses_unsupported_configuration_when_built"],
        why="canonical_layout set on the config (not the extra keys) must be refused at spec build too",
    ),
    dict(
        name="vllm-unknown-keys-accepted",
        file=_OFF,
        find="    if unknown:\n",
        replace="    if False:\n",
        tests=[_I + "test_the_spec_refuses_unsupported_configuration_when_built"],
        why="an unsupported extra-config key must fail when the spec is built, not be ignored",
    ),
    dict(
        name="vllm-release-signature-not-its-own",
        file="torch_kvswap/integrations/vllm/compat.py",
        find="    allowed = ([submit_load_era(release[1])] if release and release[0] == 0\n",
        replace="    allowed = ([SUBMIT_LOAD_PLAIN, SUBMIT_LOAD_EXPEDITED] if release and release[0] == 0\n",
        tests=[_I + "test_a_supported_release_with_the_other_releases_signature_is_refused"],
        why="each supported release must have its own era's submit_load signature",
    ),
    dict(
        name="vllm-shared-region-mirrors-overlap",
        file=_LAYOUTS,
        find="            off += rows * bb\n",
        replace="",
        tests=[_I + "test_offloaders_on_one_shared_region_see_each_others_bytes"],
        why="mirrors carved from the shared region must not overlap",
    ),
    dict(
        name="vllm-check-key-ignored",
        file="torch_kvswap/integrations/vllm/compat.py",
        find="    if value:\n        import torch_kvswap\n",
        replace="    if False:\n        import torch_kvswap\n",
        tests=["tests/test_checked.py::test_vllm_extra_config_key_turns_checked_mode_on"],
        why="a canary deployment with kvswap_check runs unchecked and still serves corrupted blocks",
    ),
    dict(
        name="vllm-release-range-not-enforced",
        file="torch_kvswap/integrations/vllm/compat.py",
        find="    elif not low <= release <= high:\n",
        replace="    elif False:\n",
        tests=[_I + "test_a_release_outside_the_range_is_refused_naming_it_what_differs_and_the_range"],
        why="a vLLM outside the supported range must be refused when the spec or connector is built",
    ),
    dict(
        name="vllm-host-chunks-num-chunks-only",
        file=_OFF,
        find='    for name in ("num_chunks", "num_blocks"):\n',
        replace='    for name in ("num_chunks",):\n',
        tests=[_I + "test_the_spec_reads_its_releases_host_chunk_count"],
        why="vLLM 0.27 to 0.29 name the host chunk count num_blocks (get_worker raised AttributeError)",
    ),
    dict(
        name="vllm-capacity-error-names-extra-config",
        file=_SPEC,
        find="capacity.\n        self._capacity_source = _capacity_source()\n",
        replace='capacity.\n        self._capacity_source = "cpu_bytes_to_use in kv_connector_extra_config"\n',
        tests=[_I + "test_a_capacity_too_small_names_what_sized_it"],
        why="host memory sized by --kv-offloading-size must be named as that flag in the error",
    ),
    dict(
        name="vllm-simple-unknown-keys-accepted",
        file=_SIMPLE,
        find="    if unknown:\n",
        replace="    if False:\n",
        tests=[_I + "test_the_simple_connector_refuses_unknown_extra_config_keys"],
        why="a mistyped simple-connector key (cpu_byte_to_use) silently got vLLM's default 8 GiB",
    ),
    dict(
        name="vllm-simple-streams-default-priority",
        file=_SIMPLE,
        find="    return (torch.Stream(device=device, priority=low), torch.Stream(device=device, priority=low))\n",
        replace="    return (torch.Stream(device=device), torch.Stream(device=device))\n",
        tests=[_I + "test_the_simple_workers_streams_are_made_at_the_lowest_priority"],
        why="the simple worker's copy streams must be low priority (as vLLM's) so copies yield to compute",
    ),
    dict(
        name="vllm-regions-without-placements-misread",
        file=_SIMPLE,
        find="        seg = tensor.stride(outer[0]) * el\n",
        replace="        seg = page\n",
        tests=[_B + "test_without_placements_k_and_v_outermost_give_two_regions_read_from_the_strides"],
        why="vLLM 0.27's K/V-outermost caches: each half is one region (a block's page spans both)",
    ),
    dict(
        name="vllm023-handler-directions-swapped",
        file=_HANDLER,
        find="                if media == STORE:\n                    self.offloader.store(",
        replace="                if media == LOAD:\n                    self.offloader.store(",
        tests=[_H + "test_vllms_worker_round_trips_blocks_byte_exact_with_the_reference_call_pattern[standin]"],
        why="a (GPU, CPU) spec is a store and a (CPU, GPU) spec a load, never the reverse",
    ),
    dict(
        name="vllm023-handler-block-indices-ignored",
        file=_HANDLER,
        find="            offsets = [int(b) % self.block_size_factor for b in device.block_indices]\n",
        replace="            offsets = None\n",
        tests=[_H + "test_a_load_may_start_mid_host_block_from_block_indices[standin]"],
        why="block_indices[g] % factor is where a group starts in its first host block (vLLM 0.23's rule)",
    ),
    dict(
        name="vllm023-handler-group-sizes-ignored",
        file=_HANDLER,
        find="                    self.offloader.store(job_id, device.block_ids, host.block_ids, offsets=offsets,\n"
             "                                         group_sizes=device.group_sizes)\n",
        replace="                    self.offloader.store(job_id, device.block_ids, host.block_ids,\n"
                "                                         offsets=offsets[:1], group_sizes=None)\n",
        tests=[_H + "test_each_kv_cache_group_moves_its_own_tensors[standin]"],
        why="a store's group_sizes split its device ids by KV-cache group",
    ),
    dict(
        name="vllm023-handler-failure-reported-as-success",
        file=_HANDLER,
        find="success=r.success,",
        replace="success=True,",
        tests=[_H + "test_a_failed_copy_is_reported_as_success_false_and_the_next_job_still_runs[standin]"],
        why="a job whose copy failed must be reported with success=False",
    ),
    dict(
        name="vllm023-handler-refused-job-keeps-its-media",
        file=_HANDLER,
        find="            except BaseException:\n                del self._media[job_id]\n                raise\n",
        replace="            except BaseException:\n                raise\n",
        tests=[_H + "test_a_job_id_refused_once_can_be_submitted_again[standin]"],
        why="a job the offloader refused was never queued: its id must be free for the next job",
    ),
    dict(
        name="vllm023-handler-offloaders-media-reported",
        file=_HANDLER,
        find="                                                     transfer_type=media))",
        replace="                                                     transfer_type=r.transfer_type))",
        tests=[_H + "test_vllms_worker_round_trips_blocks_byte_exact_with_the_reference_call_pattern[standin]"],
        why="transfer_type is the job's spec media (GPU, CPU), what vLLM keys its transfer stats by",
    ),
    dict(
        name="vllm023-handler-wait-strict-on-foreign-ids",
        file=_HANDLER,
        find="            self.offloader.wait(job_ids, strict=False)\n",
        replace="            self.offloader.wait(job_ids)\n",
        tests=[_H + "test_wait_ignores_the_ids_of_other_handlers_even_when_strict[standin]"],
        why="vLLM's worker hands every handler the whole id set: a strict handler must not raise on others'",
    ),
    dict(
        name="vllm023-handler-other-media-accepted",
        file=_HANDLER,
        find="            elif media == LOAD:\n",
        replace="            elif True:\n",
        tests=[_H + "test_a_pair_of_media_the_handler_does_not_serve_is_refused[standin]"],
        why="a (GPU, DISK) or (CPU, CPU) job must be refused, not run as a load",
    ),
    dict(
        name="vllm023-handler-range-unchecked",
        file=_COMPAT,
        find="    elif not HANDLER_RANGE[0] <= release <= HANDLER_RANGE[1]:\n",
        replace="    elif False:\n",
        tests=[_H + "test_a_release_without_the_handler_interface_is_refused_naming_it"],
        why="a release outside 0.23 to 0.24 must be refused naming the release",
    ),
    # KVSwapTieringOffloadingSpec (vLLM's tiered offloading over the worker)
    dict(
        name="vllm-tiering-blocks-per-chunk-accepted",
        file=_TIERING,
        find="        if self.blocks_per_chunk != 1:\n",
        replace="        if False:\n",
        tests=[_I + "test_the_tiering_spec_refuses_unsupported_configuration_when_built"],
        why="with more than one block per chunk the worker's mirror rows are not chunk rows: refuse it",
    ),
    dict(
        name="vllm-tiering-checked-mode-accepted",
        file=_TIERING,
        find="        if CHECK_KEY in extra:\n",
        replace="        if False:\n",
        tests=[_I + "test_the_tiering_spec_refuses_unsupported_configuration_when_built"],
        why="kvswap_check must be refused with its reason (checked mode would refuse promoted chunks)",
    ),
    dict(
        name="vllm-tiering-mirror-offsets-by-width",
        file=_LAYOUTS,
        find="            view = region.create_next_worker_view(page)\n",
        replace="            view = region.create_next_worker_view(t.shape[1])\n",
        tests=[_I + "test_the_tiering_worker_lays_its_mirrors_out_chunk_major_in_its_ranks_slot"],
        why="each tensor takes its full page of the slot, as vLLM's CPU worker does, or the tiers' "
            "bytes of the later tensors are misplaced",
    ),
    dict(
        name="vllm-tiering-region-slot-zero",
        file=_OFF,
        find='0 if getattr(spec, "replicated_layout", False) else int(parallel.rank)\n',
        replace="0\n",
        tests=[_I + "test_the_tiering_worker_maps_the_region_as_vllms_tiering_spec_does"],
        why="without the replicated layout each rank has its own slot of the row",
    ),
]
