"""Mutants of checked mode (data for scripts/mutation_check.py): one per check."""

_OPS = ["tests/test_checked.py"]
_OFF = ["tests/test_checked_offloader.py"]
_CPP = "csrc/core/checked.cpp"
_PY = "torch_kvswap/_checked.py"

MUTANTS = [
    # --- the switch ---
    dict(
        name="checked-mode-never-on",
        file=_CPP,
        find="void set_checked_mode(bool on) { g_checked_mode.store(on, std::memory_order_relaxed); }",
        replace="void set_checked_mode(bool on) { g_checked_mode.store(false, std::memory_order_relaxed); }",
        tests=_OPS,
        why="checked() must turn the core's checks on",
    ),
    dict(
        name="checked-nested-block-turns-it-off",
        file=_PY,
        find="torch.ops.kvswap._set_checked(_switched_on or _open_blocks > 0)",
        replace="torch.ops.kvswap._set_checked(_switched_on or _open_blocks == 1)",
        tests=_OPS,
        why="a nested checked() block must keep the mode on",
    ),
    # --- regions ---
    dict(
        name="checked-region-end-ignored",
        file=_CPP,
        find="if (p == 0 || t.max_end[p - 1] < x.end) {",
        replace="if (p == 0 || t.max_end[p - 1] <= x.begin) {",
        tests=_OPS,
        why="a descriptor that starts inside a region but runs past its end (an id one past "
            "the last block) must be refused",
    ),
    dict(
        name="checked-region-side-ignored",
        file=_CPP,
        find="const Side dst_side = direction == Direction::kDeviceToHost ? Side::kHost : Side::kDevice;",
        replace="const Side dst_side = Side::kHost;",
        tests=_OPS,
        why="a destination must lie in a region of the side the direction names (descriptors "
            "aimed at the wrong buffer)",
    ),
    dict(
        name="checked-freed-region-kept",
        file=_CPP,
        find="      if (!r.storage.expired()) out.push_back(r);",
        replace="      out.push_back(r);",
        tests=_OPS,
        why="a region whose memory was freed must be dropped: the addresses may be reused",
    ),
    dict(
        name="checked-offloader-caches-registered-as-host",
        file=_PY,
        find='_register_region(t, "device", f"device cache {i}")',
        replace='_register_region(t, "host", f"device cache {i}")',
        tests=_OFF,
        why="the offloader's caches are the device side of its copies",
    ),
    # --- overlaps ---
    dict(
        name="checked-destination-overlaps-unchecked",
        file=_CPP,
        find="  for (size_t k = 1; k < dsts.size(); ++k) {",
        replace="  for (size_t k = dsts.size(); k < dsts.size(); ++k) {",
        tests=_OPS,
        why="two descriptors writing the same bytes race and must be refused",
    ),
    dict(
        name="checked-chains-unchecked",
        file=_CPP,
        find="  if (!(device.is_cpu() || direction == Direction::kDeviceToDevice)) return;",
        replace="  return;",
        tests=_OPS,
        why="a descriptor reading what another writes races and must be refused",
    ),
    dict(
        name="checked-touching-chain-refused",
        file=_CPP,
        find="if (p < dsts.size() && dsts[p].begin < x.end) {",
        replace="if (p < dsts.size() && dsts[p].begin <= x.end) {",
        tests=_OPS,
        why="a source that only touches another descriptor's destination is no chain",
    ),
    dict(
        name="checked-unsorted-descriptors-not-sorted",
        file=_CPP,
        find="  if (s.sorted) return;\n",
        replace="  return;\n",
        tests=_OPS,
        why="the overlap and region walks need the descriptors in address order",
    ),
    # --- device-resident ids ---
    dict(
        name="checked-device-ids-unchecked",
        file="csrc/core/routing.cpp",
        find="  } else if (checked_mode()) {\n    check_device_resident_ids(",
        replace="  } else if (false) {\n    check_device_resident_ids(",
        tests=_OPS,
        why="ids the kernel path reads on the device must be checked like host ids",
    ),
    dict(
        name="checked-device-ids-read-back-under-capture",
        file=_CPP,
        find="  if (stream_capturing(device)) {\n    TORCH_WARN_ONCE(",
        replace="  if (false) {\n    TORCH_WARN_ONCE(",
        tests=_OPS,
        why="reading ids back synchronizes, which a capture forbids: skip with one warning",
    ),
    # --- the offloader's contract ---
    dict(
        name="checked-load-of-empty-block-allowed",
        file=_PY,
        find="hit = np.flatnonzero(~self._stored[g, host])",
        replace="hit = np.flatnonzero(self._stored[g, host] & False)",
        tests=_OFF,
        why="a load of a host block never stored fills the device with the mirror's zeros",
    ),
    dict(
        name="checked-load-racing-its-store-allowed",
        file=_PY,
        find="hit = np.flatnonzero(self._storing[h, host] != _EMPTY)",
        replace="hit = np.flatnonzero(self._storing[h, host] == -2)",
        tests=_OFF,
        why="a load of a block whose store was not reported races with the store",
    ),
    dict(
        name="checked-store-over-pending-load-allowed",
        file=_PY,
        find="hit = np.flatnonzero(self._reading[h, host] > 0)",
        replace="hit = np.flatnonzero(self._reading[h, host] > 1)",
        tests=_OFF,
        why="a store into a host block a pending load reads changes what the load copies",
    ),
    dict(
        name="checked-store-of-blocks-being-loaded-allowed",
        file=_PY,
        find="hit = np.flatnonzero(self._writing[h, dev] > 0)",
        replace="hit = np.flatnonzero(self._writing[h, dev] > 1)",
        tests=_OFF,
        why="a store of device blocks a pending load writes saves half-loaded blocks",
    ),
    dict(
        name="checked-reported-store-not-marked-stored",
        file=_PY,
        find="                self._stored[g, mine] = ok\n",
        replace="                self._stored[g, mine] = False\n",
        tests=_OFF,
        why="a store reported finished makes its host blocks loadable",
    ),
    dict(
        name="checked-failed-store-marked-stored",
        file=_PY,
        find="                self._stored[g, mine] = ok\n",
        replace="                self._stored[g, mine] = True\n",
        tests=_OFF,
        why="a store that failed leaves its host blocks empty",
    ),
    dict(
        name="checked-earlier-store-finishes-a-later-one",
        file=_PY,
        find="mine = host[self._storing[g, host] == job.job_id]",
        replace="mine = host",
        tests=_OFF,
        why="a block stored twice is pending until the later store is reported",
    ),
    dict(
        name="checked-wait-not-seen-as-finished",
        file="torch_kvswap/handler.py",
        find="                self._checks.observed(jobs)  # the caller has seen them finish\n",
        replace="                pass\n",
        tests=_OFF,
        why="a job the caller waited for has finished; a load after it is no race",
    ),
    dict(
        name="checked-groups-sharing-tensors-ignored",
        file=_PY,
        find="            related = self._related[g]\n",
        replace="            related = [g]\n",
        tests=_OFF,
        why="groups that share a cache tensor share memory, so their jobs conflict",
    ),
    dict(
        name="checked-offloader-ignores-the-mode",
        file=_PY,
        find="    if check is None:\n        check = is_checked()\n",
        replace="    if check is None:\n        check = False\n",
        tests=_OFF,
        why="an offloader built in checked mode tracks its jobs without check=True",
    ),
]
