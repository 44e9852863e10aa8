"""Mutants of what a new user sees first: the install's leftovers, the
version message of a shadowed clone, the demo's engine line and argument
checks, the bench's --plot check (setup_helpers/build_command.py,
torch_kvswap/_loader.py, torch_kvswap/bench/demo.py,
torch_kvswap/bench/throughput.py)."""

I = "tests/test_install.py"
D = "tests/test_demo_and_bench.py"

MUTANTS = [
    dict(
        name="install-fake-extension-kept-in-wheel",
        file="setup_helpers/build_command.py",
        where="remove_stale_extensions",
        find="        if path.name not in keep:\n",
        replace="        if path.name not in keep and not path.name.startswith(\"_fake\"):\n",
        tests=[I + "::test_a_build_leaves_out_every_extension_file_it_did_not_build"],
        why="pip install from a tree where the tests ran installs the in-place _fake_cuda",
    ),
    dict(
        name="install-leftover-engine-loaded",
        file="torch_kvswap/_loader.py",
        where="_load_optional",
        find="    if recorded is not None and not recorded.get(\"built\"):\n",
        replace="    if False:\n",
        tests=[I + "::test_an_engine_file_the_build_record_does_not_list_is_not_loaded_and_is_reported"],
        why="an engine file left by a build for another torch is loaded (undefined symbols, or a crash)",
    ),
    dict(
        name="install-shadowing-clone-told-to-reinstall",
        file="torch_kvswap/_loader.py",
        where="rebuild_hint",
        find="    if not is_source_tree(package_dir):\n",
        replace="    if True:\n",
        tests=[I + "::test_a_clone_imported_from_its_root_names_its_folder_and_the_fix"],
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
        tests=[D + "::test_a_demo_option_out_of_range_is_an_argument_error"],
        why="--offload-fraction 1.5 builds the cache, then fails with a ValueError and an abort",
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
