"""Mutants of the offloader, torch_kvswap/offloader/ (data for scripts/mutation_check.py)."""

_O = "torch_kvswap/offloader/"

_T = ["tests/test_offloader.py"]
_LT = "tests/test_offloader_lifecycle.py::"

MUTANTS = [
    dict(
        name="handler-offset-ignored",
        file=_O + "planning.py",
        where="Planner._spans",
        find="                skip = offs[g]\n",
        replace="                skip = 0\n",
        tests=_T,
        why="an explicit first-sub-block offset must place the first block at that sub-block, "
        "not at sub-block 0",
    ),
    dict(
        name="handler-partial-last-chunk-dropped",
        file=_O + "planning.py",
        where="Planner._spans",
        find="spans.append((skip, -(-(n + skip) // f) if n else 0))",
        replace="spans.append((skip, (n + skip) // f))",
        tests=_T,
        why="a job that ends mid chunk needs the partial last chunk counted",
    ),
    dict(
        name="handler-groups-copy-every-tensor",
        file=_O + "planning.py",
        where="Planner._copies",
        find="copies.append(Copy(self.groups[g], src, dst))",
        replace="copies.append(Copy(list(range(self.num_tensors)), src, dst))",
        tests=_T,
        why="a group's block ids must move only that group's tensors",
    ),
    dict(
        name="handler-failure-reported-as-success",
        file=_O + "lanes.py",
        where="Lanes._report",
        find="        ok = job.error is None\n",
        replace="        ok = True\n",
        tests=_T,
        why="a job whose copy failed must never be reported as a success",
    ),
    dict(
        name="handler-mirror-not-page-aligned",
        file=_O + "caches.py",
        where="mirror_layout",
        find="        total += -(-rows * bb // _PAGE) * _PAGE\n",
        replace="        total += rows * bb\n",
        tests=_T,
        why="in-place registration needs the mirror buffer to start on a page boundary",
    ),
    dict(
        name="handler-mirror-padding-64k",
        file=_O + "caches.py",
        where="mirror_layout",
        find="        total += -(-rows * bb // _PAGE) * _PAGE\n",
        replace="        total += -(-rows * bb // _PAGE) * _PAGE + 65536\n",
        tests=_T,
        why="padding must stay under one page per cache tensor",
    ),
    dict(
        name="handler-transfer-time-zero",
        file=_O + "lanes.py",
        where="_run_lane",
        find="        job.seconds = time.perf_counter() - t0\n",
        replace="        job.seconds = 0.0\n",
        tests=_T,
        why="a job that moved bytes took time; vLLM's stats divide by it",
    ),
    dict(
        name="handler-get-finished-order-reversed",
        file=_O + "lanes.py",
        where="Lanes.get_finished",
        find="                        self._ready.append(job.result)\n",
        replace="                        self._ready.insert(0, job.result)\n",
        tests=_T,
        why="results of one lane are reported in submission order",
    ),
    dict(
        name="handler-destination-repeat-check-dropped",
        file=_O + "planning.py",
        where="check_distinct_destinations",
        find="        if (ordered[1:] == ordered[:-1]).any():\n",
        replace="        if False:\n",
        tests=_T,
        why="two copies into one destination block in one job race; the job must be refused",
    ),
    dict(
        name="handler-expedited-shares-load-lane",
        file=_O + "offloader.py",
        where="KVCacheOffloader.load",
        find='"expedited" if expedited else "load",',
        replace='"load",',
        tests=_T,
        why="an expedited load must not queue behind ordinary loads",
    ),
    dict(
        name="handler-launch-under-table-lock",
        file=_O + "lanes.py",
        where="Lanes.submit",
        find="                self._fifo[lane].append(job)\n            # Launched outside",
        replace="                self._fifo[lane].append(job)\n                if self._workers is not None:\n"
        "                    self._queues[lane].put(job)\n                    return\n            # Launched outside",
        tests=_T,
        why="get_finished must not wait behind a launch",
    ),
    dict(
        name="handler-exit-leaves-jobs-in-flight",
        file=_O + "lanes.py",
        where="Lanes.__init__",
        find="        _LIVE.add(self)  # shut down at interpreter exit",
        replace="        pass  # shut down at interpreter exit",
        tests=["tests/test_exit.py"],
        why="an offloader left running at exit is cut off inside a copy: the process aborts "
        "(terminate called without an active exception) instead of exiting with its own status",
    ),
    dict(
        name="handler-group-caches-may-alias",
        file=_O + "offloader.py",
        where="KVCacheOffloader._take_caches",
        find="        check_groups_do_not_alias(self.device_tensors, self.cache_names, self.groups)\n",
        replace="",
        tests=["tests/test_aliasing.py"],
        why="two caches of one group that share memory would have every load refused as a failed job, "
        "not at construction",
    ),
    dict(
        name="handler-interleaved-caches-seen-as-aliasing",
        file=_O + "caches.py",
        where="check_groups_do_not_alias",
        find="                        continue  # interleaved: every block of one sits in the other's gaps",
        replace="                        pass",
        tests=["tests/test_aliasing.py"],
        why="K and V views of one [num_blocks, 2, ...] cache interleave without sharing a byte",
    ),
    dict(
        name="handler-strict-loads-unchecked",
        file=_O + "strict.py",
        where="StoreRecord.admit",
        find="            if not stored.all():",
        replace="            if False:",
        tests=_T,
        why="strict=True must refuse a load of a host block that no store has written",
    ),
    dict(
        name="handler-strict-failed-store-counts-as-stored",
        file=_O + "strict.py",
        where="StoreRecord.finish",
        find="            failed[self._last_store[rows] == job.serial] = job.job_id",
        replace="            pass",
        tests=_T,
        why="a failed store may have written part of its blocks: they are not stored",
    ),
    dict(
        name="handler-strict-wait-lenient",
        file=_O + "offloader.py",
        where="KVCacheOffloader.wait",
        find="self._lanes.wait(job_ids, self.strict if strict is None else strict)",
        replace="self._lanes.wait(job_ids, bool(strict))",
        tests=_T,
        why="an offloader built with strict=True must refuse waits on unknown ids",
    ),
    dict(
        name="handler-job-id-unchecked",
        file=_O + "offloader.py",
        where="KVCacheOffloader.store",
        find='''as_job_id(job_id),
            "store",''',
        replace='''job_id,
            "store",''',
        tests=_T,
        why="a job id that is not an int must raise a TypeError naming job_id",
    ),
    dict(
        name="handler-job-ids-not-checked",
        file=_O + "lanes.py",
        where="Lanes.wait",
        find="        wanted = as_job_ids(job_ids)",
        replace="        wanted = set(job_ids)",
        tests=_T,
        why="wait(1) must say that job_ids is an iterable of ids, not 'int object is not iterable'",
    ),
    dict(
        name="handler-cache-names-dropped",
        file=_O + "caches.py",
        where="flatten_caches",
        find='            names.extend([f"{key} K", f"{key} V"] if stacked else [key])',
        replace='            names.extend([f"tensor {len(names)}", f"tensor {len(names) + 1}"] if stacked else [key])',
        tests=_T,
        why="an offloader error names the cache by its key and K or V, not by a flattened index",
    ),
    dict(
        name="handler-frees-memory-the-runtime-may-still-have-registered",
        file=_O + "host_memory.py",
        where="HostMemory._refuse",
        find='        if "may still be registered" in str(exc):\n',
        replace="        if False:\n",
        tests=[
            "tests/test_ascend_fake.py::test_fake_npu[main-cases_cann-"
            "test_a_registration_that_can_be_neither_confirmed_nor_undone_is_never_freed]"
        ],
        why="issue 25: a buffer whose registration could not be undone was dropped; the "
        "allocator would hand registered pages out again",
    ),
    dict(
        name="simple-mirrors-free-memory-the-runtime-may-still-have-registered",
        file=_O + "host_memory.py",
        where="HostMemory._refuse",
        find='        if "may still be registered" in str(exc):\n',
        replace="        if False:\n",
        tests=[
            "tests/test_ascend_fake.py::test_fake_npu[main-cases_cann-"
            "test_the_simple_connectors_mirrors_keep_a_registration_that_could_not_be_undone]"
        ],
        why="the simple connector's host mirrors had their own allocator without this guard: "
        "a registration that could not be undone went back to the allocator",
    ),
    # --- host memory: exact size, pre-faulting, chunked registration, NUMA ------------
    dict(
        name="host-memory-rounds-to-a-power-of-two",
        file=_O + "host_memory.py",
        where="map_exact",
        find="    size = max(-(-int(nbytes) // PAGE) * PAGE, PAGE)",
        replace="    size = max(1 << (int(nbytes) - 1).bit_length(), PAGE)",
        tests=["tests/test_host_memory.py"],
        why="issue 36: the pinned allocator's power-of-two rounding took up to 2x the memory asked for",
    ),
    dict(
        name="host-memory-registers-in-one-call",
        file=_O + "host_memory.py",
        where="chunks",
        find="    return [(a, min(a + chunk_bytes, nbytes)) for a in range(0, nbytes, chunk_bytes)]",
        replace="    return [(0, nbytes)] if nbytes else []",
        tests=["tests/test_host_memory.py"],
        why="one registration of 512 GiB or more is refused; chunks of at most 64 GiB are not",
    ),
    dict(
        name="host-memory-refused-chunk-leaves-earlier-chunks-registered",
        file=_O + "host_memory.py",
        where="HostMemory._refuse",
        find="        unregister_chunks(self.buffer, self.device, self.registered)\n",
        replace="",
        tests=["tests/test_host_memory.py"],
        why="a refused chunk must undo the chunks before it, or they stay page-locked for good",
    ),
    dict(
        name="host-memory-wait-returns-while-registering",
        file=_O + "host_memory.py",
        where="HostMemory.wait",
        find="            wait_for(self._done)\n",
        replace="            pass\n",
        tests=["tests/test_host_memory.py"],
        why="a job would copy into mirrors not yet page-locked: refused, or before CANN 8.1 corrupted",
    ),
    dict(
        name="host-memory-job-does-not-wait-for-its-chunk",
        file=_O + "offloader.py",
        where="KVCacheOffloader._submit",
        find="        self._wait_for_mirrors()\n",
        replace="",
        tests=[
            "tests/test_ascend_fake.py::test_fake_npu[main-cases_host_memory-"
            "test_construction_returns_before_registration_ends_and_the_first_job_waits_for_it]"
        ],
        why="a copy into mirrors not yet page-locked is refused (or, before CANN 8.1, corrupts)",
    ),
    dict(
        name="host-memory-not-prefaulted",
        file=_O + "host_memory.py",
        where="_populate",
        find="    return _libc.madvise(address, length, MADV_POPULATE_WRITE) == 0",
        replace="    return True",
        tests=["tests/test_host_memory.py"],
        why="pages left to fault on the first copy make the first jobs slow; ready means resident",
    ),
    dict(
        name="prefault-keeps-the-slower-method",
        file=_O + "host_memory.py",
        where="prefault",
        find='method, start = ("madvise" if t1 - t0 <= t2 - t1 else "touch"), 2 * PROBE_BYTES',
        replace='method, start = ("madvise" if t1 - t0 > t2 - t1 else "touch"), 2 * PROBE_BYTES',
        tests=["tests/test_host_memory.py"],
        why="under a hypervisor that shadows page tables MADV_POPULATE_WRITE took 2x the touch: "
        "8 GiB of mirrors ready in 2.2x torch.zeros instead of 0.9x",
    ),
    dict(
        name="prefault-probes-a-small-buffer",
        file=_O + "host_memory.py",
        where="prefault",
        find="if n >= 4 * PROBE_BYTES:",
        replace="if n >= 3 * PROBE_BYTES:",
        tests=["tests/test_host_memory.py"],
        why="the probes would be most of a small buffer, their timing noise deciding the method",
    ),
    dict(
        name="host-memory-registers-before-construction-returns",
        file=_O + "host_memory.py",
        where="HostMemory.__init__",
        find="            self._thread.start()\n",
        replace="            self._thread.start()\n            self._thread.join()\n",
        tests=[
            "tests/test_host_memory_cuda_fake.py::"
            "test_construction_returns_before_registration_ends_and_a_wait_blocks_until_it_does",
            "tests/test_ascend_fake.py::test_fake_npu[main-cases_host_memory-"
            "test_construction_returns_before_registration_ends_and_the_first_job_waits_for_it]",
        ],
        why="page-locking hundreds of GiB at about 0.1 s per GB would hold up start-up by minutes",
        timeout=120,
    ),
    dict(
        name="numa-binding-skipped",
        file=_O + "host_memory.py",
        where="HostMemory.__init__",
        find="            bind(self.buffer.data_ptr(), self.buffer._base.numel(), numa_node)",
        replace="            pass",
        tests=["tests/test_host_memory.py"],
        why="mirrors on the wrong NUMA node copy at a third of the bandwidth on Grace-Blackwell",
    ),
    dict(
        name="numa-override-ignored",
        file=_O + "numa.py",
        where="choose_node",
        find="        return numa_node\n",
        replace="",
        tests=["tests/test_host_memory.py"],
        why="numa_node=N must place the mirrors on node N whatever the device's node",
    ),
    dict(
        name="numa-binds-on-a-one-node-machine",
        file=_O + "numa.py",
        where="choose_node",
        find='    if device.type == "cpu" or node_count() < 2:',
        replace='    if device.type == "cpu":',
        tests=["tests/test_host_memory.py"],
        why="nothing changes on a one-node machine",
    ),
    dict(
        name="numa-node-count-ignores-ranges",
        file=_O + "numa.py",
        where="node_count",
        find="            count += int(hi or lo) - int(lo) + 1",
        replace="            count += 1",
        tests=["tests/test_host_memory.py"],
        why="has_memory lists ranges (0-1): a two-node machine read as one would never bind",
    ),
    dict(
        name="offloader-interrupted-shutdown-leaves-exit-list",
        file=_O + "lanes.py",
        where="Lanes.shutdown",
        find="        with self._lock:\n            self._closed = True\n",
        replace="        _LIVE.discard(self)\n        with self._lock:\n            self._closed = True\n",
        tests=[
            _LT + "test_an_interrupted_shutdown_stays_registered_for_exit_and_a_second_shutdown_finishes_it",
            _LT + "test_ctrl_c_during_shutdown_ends_the_process_by_sigint_after_the_jobs_finish",
        ],
        why="an offloader whose shutdown Ctrl-C interrupted must stay on the exit list until its "
        "workers stop: off it, exit leaves them copying into interpreter teardown (abort, 134)",
    ),
    dict(
        name="offloader-second-shutdown-returns-at-once",
        file=_O + "lanes.py",
        where="Lanes.shutdown",
        find="        with self._lock:\n            self._closed = True\n",
        replace="        with self._lock:\n            if self._closed:\n                return\n"
        "            self._closed = True\n",
        tests=[
            _LT + "test_an_interrupted_shutdown_stays_registered_for_exit_and_a_second_shutdown_finishes_it",
            _LT + "test_ctrl_c_during_shutdown_ends_the_process_by_sigint_after_the_jobs_finish",
        ],
        why="a shutdown after an interrupted one must finish it, not return with jobs pending",
    ),
    dict(
        name="offloader-forked-child-exit-waits-on-parent-threads",
        file=_O + "lanes.py",
        where="_forget_the_parents_offloaders",
        find="    _generation += 1\n    _LIVE.clear()",
        replace="    pass",
        tests=[_LT + "test_a_child_forked_with_jobs_in_flight_exits_at_once_with_its_own_status"],
        why="a child forked with jobs in flight would wait at exit for threads that exist only "
        "in the parent: it hangs",
    ),
    dict(
        name="offloader-forked-child-uses-parent-offloader",
        file=_O + "lanes.py",
        where="Lanes._check_process",
        find="        if self._generation != _generation:",
        replace="        if False:",
        tests=[_LT + "test_a_forked_child_that_uses_its_parents_offloader_gets_a_clear_error"],
        why="in a forked child the parent's offloader has no workers: a job stored there never "
        "finishes and wait hangs; it must refuse, naming fork and the way out",
    ),
    dict(
        name="offloader-threads-hold-their-offloader",
        file=_O + "lanes.py",
        where="Lanes.__init__",
        find="            owner = weakref.ref(self)",
        replace="            owner = lambda: self  # noqa: E731",
        tests=[
            _LT + "test_ten_dropped_offloaders_are_collected_their_threads_stop_and_their_mirrors_are_freed"
        ],
        why="worker threads that hold their offloader keep a dropped one, its threads and its "
        "mirrors, until exit",
    ),
    dict(
        name="lanes-copy-function-holds-its-offloader",
        file=_O + "offloader.py",
        where="_copier",
        find="    owner = weakref.ref(offloader)",
        replace="    owner = lambda: offloader  # noqa: E731",
        tests=[
            _LT + "test_ten_dropped_offloaders_are_collected_their_threads_stop_and_their_mirrors_are_freed"
        ],
        why="lanes whose copy function holds the offloader keep a dropped one, its threads and its "
        "mirrors, until a garbage collection finds the cycle",
    ),
    dict(
        name="offloader-base-exception-kills-the-lane",
        file=_O + "lanes.py",
        where="_run_lane",
        find="        except BaseException as exc:",
        replace="        except Exception as exc:",
        tests=[_LT + "test_any_exception_inside_a_copy_fails_that_job_and_the_lane_keeps_working"],
        why="SystemExit or KeyboardInterrupt inside a copy ended the worker: the job was never "
        "reported, wait blocked forever and later jobs never ran",
    ),
    dict(
        name="offloader-wait-sleeps-through-a-signal",
        file=_O + "waits.py",
        where="wait_for",
        find="    while not event.wait(SIGNAL_CHECK_SECONDS):\n        pass\n",
        replace="    event.wait()\n",
        tests=[_LT + "test_a_signal_another_thread_took_interrupts_the_call_while_the_copy_runs"],
        why="Ctrl-C that the kernel handed to a worker thread waited for the copy to end (30 s "
        "and more) before wait or shutdown raised KeyboardInterrupt",
    ),
    dict(
        name="offloader-lane-wait-sleeps-through-a-signal",
        file=_O + "lanes.py",
        where="Lanes.wait",
        find="                wait_for(job.done)\n",
        replace="                job.done.wait()\n",
        tests=[_LT + "test_a_signal_another_thread_took_interrupts_the_call_while_the_copy_runs"],
        why="wait and shutdown slept through Ctrl-C until the copy ended",
    ),
    dict(
        name="offloader-registration-wait-sleeps-through-a-signal",
        file=_O + "host_memory.py",
        where="HostMemory.wait",
        find="            wait_for(self._done)\n",
        replace="            self._done.wait()\n",
        tests=[
            "tests/test_host_memory.py::test_a_signal_another_thread_took_interrupts_the_wait_for_registration"
        ],
        why="the first job's wait for page-locking slept through Ctrl-C until registration ended",
    ),
    dict(
        name="offloader-job-reads-the-callers-id-array-at-copy-time",
        file=_O + "planning.py",
        where="as_ids",
        find="    return np.array(arr, dtype=np.int64)",
        replace="    return arr.astype(np.int64, copy=False)",
        tests=[
            "tests/test_offloader.py::"
            "test_a_job_keeps_its_own_ids_and_the_caller_may_reuse_its_arrays_once_the_call_returns"
        ],
        why="a job shared the caller's int64 array or CPU tensor of ids: refilled for the next step "
        "before the job ran, it copied the wrong blocks, in silence",
    ),
    dict(
        name="lane-dies-when-the-report-raises",
        file=_O + "lanes.py",
        where="_run_lane",
        find="""            try:
                lanes._fail(job, exc)
            except BaseException as report_exc:  # noqa: BLE001 - the report raised: the job still fails
                job.error = job.error or describe(report_exc)
""",
        replace="""            lanes._fail(job, exc)
""",
        tests=[_LT + "test_a_report_that_raises_fails_the_job_and_the_lane_keeps_working"],
        why="a log handler that raised while a failed copy was reported ended the lane's thread: "
        "the next job never ran, and wait and exit hung",
    ),
    dict(
        name="job-error-formats-an-unprintable-exception",
        file=_O + "lanes.py",
        where="describe",
        find='        return f"{name} (its message could not be formatted)"',
        replace="""        raise""",
        tests=[_LT + "test_a_report_that_raises_fails_the_job_and_the_lane_keeps_working"],
        why="an exception whose __str__ raises must still give the job an error text",
    ),
    dict(
        name="log-handler-error-escapes-the-report",
        file=_O + "lanes.py",
        where="Lanes._fail",
        find="with contextlib.suppress(Exception):",
        replace="with contextlib.suppress(ArithmeticError):",
        tests=[_LT + "test_failing_a_job_never_raises_when_the_log_handler_does"],
        why="a failed launch is reported on the caller's thread: a raising log handler escaped store()",
    ),
    dict(
        name="get-finished-drops-results-an-interrupt-cut-off",
        file=_O + "lanes.py",
        where="Lanes.get_finished",
        find="""                    job = fifo[0]
                    if job.result is None:
                        job.result = self._report(job)
                    if not (self._ready and self._ready[-1] is job.result):
                        self._ready.append(job.result)
                    fifo.popleft()""",
        replace="""                    job = fifo.popleft()
                    self._ready.append(self._report(job))""",
        tests=["tests/test_offloader_model.py::test_ctrl_c_inside_get_finished_loses_no_report"],
        why="Ctrl-C inside get_finished lost the jobs it had taken off their queue: never reported",
    ),
    dict(
        name="strict-failed-store-unmarks-a-later-stores-rows",
        file=_O + "strict.py",
        where="StoreRecord.finish",
        find="failed[self._last_store[rows] == job.serial] = job.job_id",
        replace="failed[self._last_store[rows] >= 0] = job.job_id",
        tests=[
            "tests/test_offloader.py::"
            "test_strict_load_after_a_failed_store_and_a_good_store_of_the_same_block_is_admitted"
        ],
        why="a failed store must not unmark host rows that a later store rewrote",
    ),
    dict(
        name="strict-failed-store-reads-as-never-stored",
        file=_O + "strict.py",
        where="StoreRecord.admit",
        find="                if failed >= 0:",
        replace="                if False:",
        tests=[
            "tests/test_offloader.py::test_strict_load_of_a_block_whose_only_store_failed_names_the_failed_job"
        ],
        why="a load of a block whose store failed must say so, not that no store wrote it",
    ),
    dict(
        name="shut-down-offloader-gives-no-way-forward",
        file=_O + "lanes.py",
        where="Lanes.submit",
        find='"available from get_finished(). Build a new KVCacheOffloader for more jobs"',
        replace='"available from get_finished()"',
        tests=["tests/test_offloader.py::test_a_shut_down_offloader_says_what_to_do_instead"],
        why="the error must say what to do instead",
    ),
]
