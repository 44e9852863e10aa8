"""Mutants of the build and install logic (setup.py, setup_helpers/, the
version guard in torch_kvswap/_loader.py, the environment report). Each breaks
one decision that tests/test_install.py pins down."""

T = "tests/test_install.py"

MUTANTS = [
    dict(
        name="install-version-guard-ignores-patch-release",
        file="torch_kvswap/_loader.py",
        find="    if release(built) != release(running):\n",
        replace="    if release(built)[:2] != release(running)[:2]:\n",
        tests=[T + "::test_extension_built_for_another_torch_fails_to_import_with_the_version_message"],
        why="an extension built for torch 2.13.1 loads under 2.13.0 and fails with an undefined symbol",
    ),
    dict(
        name="install-version-guard-compares-local-tags",
        file="torch_kvswap/_build_shared.py",
        find='    return tuple(int(x) for x in re.findall(r"\\d+", version.split("+")[0])[:3])\n',
        replace='    return tuple(int(x) for x in re.findall(r"\\d+", version)[:3]) + (version,)\n',
        tests=[T + "::test_version_guard_accepts_the_same_release_of_another_build_variant"],
        why="a CPU build of torch 2.13.0 refuses an extension built against the CUDA build of 2.13.0",
    ),
    dict(
        name="install-cuda-major-mismatch-builds",
        file="setup_helpers/engines.py",
        find="    if f.torch_cuda and release(f.torch_cuda)[0] != release(f.nvcc_version)[0]:\n",
        replace="    if False:\n",
        tests=[T + "::test_nvcc_of_another_major_version_than_torch_skips_the_engine"],
        why="torch built with CUDA 12.8 and nvcc 13.0: torch's builder raises and the install fails",
    ),
    dict(
        name="install-no-default-archs-without-gpu",
        file="setup_helpers/engines.py",
        find="    if arch_list is None and f.visible_gpus == 0:\n",
        replace="    if arch_list is None and f.visible_gpus < 0:\n",
        tests=[T + "::test_cuda_engine_on_a_machine_with_nvcc_and_no_gpu_builds_for_the_default_archs"],
        why="nvcc and no GPU: torch's arch detection finds no device and crashes (IndexError)",
    ),
    dict(
        name="install-ptx-on-oldest-arch",
        file="setup_helpers/engines.py",
        find="        kept[-1] += \"+PTX\"\n",
        replace="        kept[0] += \"+PTX\"\n",
        tests=[T + "::test_default_archs_drop_what_nvcc_cannot_target_and_keep_ptx_on_the_newest"],
        why="PTX for the oldest architecture only: newer GPUs JIT old code, or none at all",
    ),
    dict(
        name="install-build-env-torch-accepted",
        file="setup.py",
        find='    if "pip-build-env" in str(Path(torch.__file__).resolve()):\n',
        replace='    if "pip-build-env-never" in str(Path(torch.__file__).resolve()):\n',
        tests=[T + "::test_a_torch_inside_pips_isolated_build_environment_is_refused"],
        why="an isolated build that fetched its own torch compiles against a torch the user does not run",
    ),
    dict(
        name="install-old-torch-accepted",
        file="setup.py",
        find="    if release(torch.__version__)[:2] < MIN_TORCH:\n",
        replace="    if release(torch.__version__)[:1] < MIN_TORCH[:1]:\n",
        tests=[T + "::test_a_torch_older_than_the_oldest_supported_release_is_refused"],
        why="torch 2.9 starts a build that fails deep in the compiler instead of saying which torch is needed",
    ),
    dict(
        name="install-forced-engine-silently-skipped",
        file="setup_helpers/engines.py",
        find="        if d.forced and not d.build:\n",
        replace="        if d.forced and not d.build and False:\n",
        tests=[T + "::test_a_forced_engine_that_cannot_be_built_stops_the_build"],
        why="KVSWAP_BUILD_CUDA=1 on a machine without a toolkit builds without the engine and says nothing",
    ),
    dict(
        name="install-report-hides-not-built-reason",
        file="torch_kvswap/envreport.py",
        find="            state = engine_state(key, entry)\n",
        replace="            state = \"not built\"\n",
        tests=[T + "::test_environment_report_runs_from_outside_the_tree_and_reports_the_host_engine"],
        why="the bug report says an engine is missing but not why or how to enable it",
    ),
    dict(
        name="install-nvcc-arch-listing-misread",
        file="setup_helpers/engines.py",
        find='    return [f"{m[:-1]}.{m[-1]}" for m in re.findall(r"compute_(\\d+)\\b", listing)]\n',
        replace='    return [f"{m[0]}.{m[1:]}" for m in re.findall(r"compute_(\\d+)\\b", listing)]\n',
        tests=[T + "::test_nvcc_arch_listing_is_read_as_torch_arch_names"],
        why="compute_100 read as 1.00: Blackwell (10.0, 12.0) silently left out of the default architectures",
    ),
    dict(
        name="install-npu-old-acl-headers-missed",
        file="setup.py",
        find='include_dirs=[str(include), str(include / "third_party" / "acl" / "inc")],',
        replace='include_dirs=[str(include)],',
        tests=[T + "::test_ascend_build_finds_acl_headers_where_torch_npu_2_10_0_post4_keeps_them"],
        why="torch-npu 2.10.0.post4 has no include/acl/: acl_real.cpp fails and every vllm-ascend user loses the engine",
    ),
    dict(
        name="install-npu-libtorch-npu-not-linked",
        file="setup.py",
        find='f"-L{npu_root / \'lib\'}", "-ltorch_npu", ',
        replace='f"-L{npu_root / \'lib\'}", ',
        tests=[T + "::test_ascend_build_depends_on_libtorch_npu_only_where_the_engine_calls_into_it"],
        why="under torch 2.10 the engine calls NPUStream::stream(): without the library, _C_npu fails to import "
            "with an undefined symbol",
    ),
]
