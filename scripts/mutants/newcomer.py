"""Mutants of what a new user sees first: the install's leftovers, the
version message of a shadowed clone, the demo's engine line and argument
checks, the bench's --plot check (setup_helpers/build_command.py,
torch_kvswap/_loader.py, torch_kvswap/bench/demo.py,
torch_kvswap/bench/throughput.py)."""

INSTALL = "tests/test_install.py"
D = "tests/test_demo_and_bench.py"
U = "tests/test_demo_usage.py"

MUTANTS = [
    dict(
        name="install-fake-extension-kept-in-wheel",
        file="setup_helpers/build_command.py",
        where="remove_stale_extensions",
        find="        if path.name not in keep:\n",
        replace="        if path.name not in keep and not path.name.startswith(\"_fake\"):\n",
        tests=[INSTALL + "::test_a_build_leaves_out_every_extension_file_it_did_not_build"],
        why="pip install from a tree where the tests ran installs the in-place _fake_cuda",
    ),
    dict(
        name="install-leftover-engine-loaded",
        file="torch_kvswap/_loader.py",
        where="_load_optional",
        find="    if recorded is not None and not recorded.get(\"built\"):\n",
        replace="    if False:\n",
        tests=[
            INSTALL + "::test_an_engine_file_the_build_record_does_not_list_is_not_loaded_and_is_reported"
        ],
        why="an engine file left by a build for another torch is loaded (undefined symbols, or a crash)",
    ),
    dict(
        name="install-shadowing-clone-told-to-reinstall",
        file="torch_kvswap/_loader.py",
        where="rebuild_hint",
        find="    if not is_source_tree(package_dir):\n",
        replace="    if True:\n",
        tests=[INSTALL + "::test_a_clone_imported_from_its_root_names_its_folder_and_the_fix"],
        why="a clone imported from its root is told to reinstall, which does not help",
    ),
    dict(
        name="demo-names-a-loaded-engine",
        file="torch_kvswap/bench/demo.py",
        where="engine_name",
        find="    key = _loader.engine_for(device)\n    if key is None:\n",
        replace="    key = next((k for k, v in torch_kvswap.ENGINES.items() if v), \"host\")\n    if key is None:\n",
        tests=[D + "::test_the_demo_names_the_engine_whose_kernel_received_every_byte"],
        why="a CUDA build of torch with no GPU: the demo names the CUDA engine, the host engine copied",
    ),
    dict(
        name="demo-fraction-above-one-accepted",
        file="torch_kvswap/bench/demo.py",
        find='fraction = number(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")\n',
        replace='fraction = number(float, lambda v: 0 < v, "a fraction in (0, 1]")\n',
        tests=[U + "::test_an_option_out_of_its_range_is_a_usage_error"],
        why="--offload-fraction 1.5 builds the cache, then fails with a ValueError and an abort",
    ),
    dict(
        name="demo-device-not-checked",
        file="torch_kvswap/bench/demo.py",
        where="device_option",
        find="    if not usable:\n",
        replace="    if device is None:\n",
        tests=[U + "::test_a_device_torch_cannot_use_is_a_usage_error"],
        why="--device cuda on a CPU build of torch is accepted, then fails allocating with a traceback",
    ),
    dict(
        name="demo-device-index-past-the-count",
        file="torch_kvswap/bench/demo.py",
        where="device_option",
        find="device.index < acc[1]",
        replace="device.index <= acc[1]",
        tests=[U + "::test_a_device_past_the_accelerators_count_or_of_another_kind_is_refused"],
        why="--device cuda:2 on a machine with two GPUs is accepted, then fails with a traceback",
    ),
    dict(
        name="demo-cache-grows-past-cache-gib",
        file="torch_kvswap/bench/demo.py",
        where="make_plan",
        find="    num_blocks = int(args.cache_gib * 2**30) // (tensors * per_block)\n",
        replace="    num_blocks = max(args.factor, int(args.cache_gib * 2**30) // (tensors * per_block))\n",
        tests=[
            U + "::test_a_size_option_fits_the_cache_up_to_its_largest_value",
            U + "::test_too_many_layers_for_the_cache_names_both_and_is_refused_before_building",
        ],
        why="--layers 20000 builds a 2.4 GiB cache for --cache-gib 1 and runs for many minutes",
    ),
    dict(
        name="demo-memory-not-checked",
        file="torch_kvswap/bench/demo.py",
        where="check_memory",
        find="        if free is not None and need > free:\n",
        replace="        if False:\n",
        tests=[U + "::test_a_cache_beyond_this_machines_memory_is_refused"],
        why="a --cache-gib beyond the machine's memory ends in an allocator traceback",
    ),
    dict(
        name="demo-host-mirror-padding-not-counted",
        file="torch_kvswap/bench/demo.py",
        where="Plan.host_bytes",
        find="        mirror = moved + 4096 * (self.tensors + 1)\n",
        replace="        mirror = moved\n",
        tests=[U + "::test_the_run_fits_in_exactly_the_free_host_memory"],
        why="a cache of many small tensors passes the memory check and then fails allocating its mirror",
    ),
    dict(
        name="demo-seed-past-the-generators-range",
        file="torch_kvswap/bench/demo.py",
        find='seed_int = number(int, lambda v: 0 <= v < 2**64, "an integer in [0, 2**64)")',
        replace='seed_int = number(int, lambda v: 0 <= v, "an integer in [0, 2**64)")',
        tests=[U + "::test_a_bounded_option_takes_its_largest_value_and_refuses_the_next"],
        why="--seed 2**64 builds nothing and ends in torch.Generator's overflow traceback",
    ),
    dict(
        name="bench-plot-checked-after-the-run",
        file="torch_kvswap/bench/throughput.py",
        where="parse_args",
        find="    if args.plot and not matplotlib_available():\n",
        replace="    if False:\n",
        tests=[D + "::test_bench_refuses_plot_without_matplotlib_before_the_run"],
        why="--plot without matplotlib runs the whole bench, then has no plot to write",
    ),
]
