"""Mutants of the build and install logic (setup.py, setup_helpers/, the
version guard in torch_kvswap/_loader.py, the environment report). Each breaks
one decision that tests/test_install.py pins down."""

T = "tests/test_install.py"

MUTANTS = [
    dict(
        name="install-version-guard-ignores-patch-release",
        file="torch_kvswap/_loader.py",
        where="check_built_against",
        find="    if release(built) != release(running):\n",
        replace="    if release(built)[:2] != release(running)[:2]:\n",
        tests=[T + "::test_extension_built_for_another_torch_fails_to_import_with_the_version_message"],
        why="an extension built for torch 2.13.1 loads under 2.13.0 and fails with an undefined symbol",
    ),
    dict(
        name="install-version-guard-compares-local-tags",
        file="torch_kvswap/_build_shared.py",
        where="release",
        find="    return (tuple(parts) + (0, 0))[:3]\n",
        replace="    return (tuple(parts) + (0, 0))[:3] + (version,)\n",
        tests=[T + "::test_version_guard_accepts_the_same_release_of_another_build_variant"],
        why="a CPU build of torch 2.13.0 refuses an extension built against the CUDA build of 2.13.0",
    ),
    dict(
        name="install-release-keeps-a-short-version-short",
        file="torch_kvswap/_build_shared.py",
        where="release",
        find="    return (tuple(parts) + (0, 0))[:3]\n",
        replace="    return tuple(parts)[:3]\n",
        tests=[T + "::test_release_compares_a_short_version_equal_to_its_full_form"],
        why="release('2.10') != release('2.10.0'): a torch that reports '2.10' fails the version guard",
    ),
    dict(
        name="install-line-lets-pip-break-torchs-setuptools-pin",
        file="torch_kvswap/_build_shared.py",
        find="PREREQUISITES = 'pip install \"setuptools>=70.1\" ninja numpy torch'\n",
        replace="PREREQUISITES = 'pip install \"setuptools>=70.1\" ninja numpy'\n",
        tests=[T + "::test_the_install_line_keeps_setuptools_within_what_the_installed_torch_requires"],
        why="on torch 2.11 or 2.12 the install line upgrades setuptools to 84, which torch's own "
        "requirement (< 82) forbids: pip reports a conflict",
    ),
    dict(
        name="install-cuda-major-mismatch-builds",
        file="setup_helpers/engines.py",
        where="decide_cuda",
        find="    if f.torch_cuda and release(f.torch_cuda)[0] != release(f.nvcc_version)[0]:\n",
        replace="    if False:\n",
        tests=[T + "::test_nvcc_of_another_major_version_than_torch_skips_the_engine"],
        why="torch built with CUDA 12.8 and nvcc 13.0: torch's builder raises and the install fails",
    ),
    dict(
        name="install-no-default-archs-without-gpu",
        file="setup_helpers/engines.py",
        where="decide_cuda",
        find="    if arch_list is None and f.visible_gpus == 0:\n",
        replace="    if arch_list is None and f.visible_gpus < 0:\n",
        tests=[T + "::test_cuda_engine_on_a_machine_with_nvcc_and_no_gpu_builds_for_the_default_archs"],
        why="nvcc and no GPU: torch's arch detection finds no device and crashes (IndexError)",
    ),
    dict(
        name="install-ptx-on-oldest-arch",
        file="setup_helpers/engines.py",
        where="default_cuda_archs",
        find="        kept[-1] += \"+PTX\"\n",
        replace="        kept[0] += \"+PTX\"\n",
        tests=[T + "::test_default_archs_drop_what_nvcc_cannot_target_and_keep_ptx_on_the_newest"],
        why="PTX for the oldest architecture only: newer GPUs JIT old code, or none at all",
    ),
    dict(
        name="install-build-env-torch-accepted",
        file="setup.py",
        where="import_build_torch",
        find='    if "pip-build-env" in str(Path(torch.__file__).resolve()):\n',
        replace='    if "pip-build-env-never" in str(Path(torch.__file__).resolve()):\n',
        tests=[T + "::test_a_torch_inside_pips_isolated_build_environment_is_refused"],
        why="an isolated build that fetched its own torch compiles against a torch the user does not run",
    ),
    dict(
        name="install-old-torch-accepted",
        file="setup.py",
        where="import_build_torch",
        find="    if release(torch.__version__)[:2] < MIN_TORCH:\n",
        replace="    if release(torch.__version__)[:1] < MIN_TORCH[:1]:\n",
        tests=[T + "::test_a_torch_older_than_the_oldest_supported_release_is_refused"],
        why="torch 2.9 starts a build that fails deep in the compiler instead of saying which torch is needed",
    ),
    dict(
        name="install-forced-engine-silently-skipped",
        file="setup_helpers/engines.py",
        where="refuse_impossible_forced",
        find="        if d.forced and not d.build:\n",
        replace="        if d.forced and not d.build and False:\n",
        tests=[T + "::test_a_forced_engine_that_cannot_be_built_stops_the_build"],
        why="KVSWAP_BUILD_CUDA=1 on a machine without a toolkit builds without the engine and says nothing",
    ),
    dict(
        name="install-report-hides-not-built-reason",
        file="torch_kvswap/envreport.py",
        where="engine_rows",
        find="            state = engine_state(key, entry)\n",
        replace="            state = \"not built\"\n",
        tests=[T + "::test_environment_report_runs_from_outside_the_tree_and_reports_the_host_engine"],
        why="the bug report says an engine is missing but not why or how to enable it",
    ),
    dict(
        name="install-nvcc-arch-listing-misread",
        file="setup_helpers/engines.py",
        where="parse_gpu_archs",
        find='    return [f"{m[:-1]}.{m[-1]}" for m in re.findall(r"compute_(\\d+)\\b", listing)]\n',
        replace='    return [f"{m[0]}.{m[1:]}" for m in re.findall(r"compute_(\\d+)\\b", listing)]\n',
        tests=[T + "::test_nvcc_arch_listing_is_read_as_torch_arch_names"],
        why="compute_100 read as 1.00: Blackwell (10.0, 12.0) silently left out of the default architectures",
    ),
    dict(
        name="install-npu-old-acl-headers-missed",
        file="setup.py",
        where="npu_extension",
        find='include_dirs=[str(include), str(include / "third_party" / "acl" / "inc")],',
        replace='include_dirs=[str(include)],',
        tests=[T + "::test_ascend_build_finds_acl_headers_where_torch_npu_2_10_0_post4_keeps_them"],
        why="torch-npu 2.10.0.post4 has no include/acl/: acl_real.cpp fails and every vllm-ascend user loses the engine",
    ),
    dict(
        name="install-npu-libtorch-npu-not-linked",
        file="setup.py",
        where="npu_extension",
        find='f"-L{npu_root / \'lib\'}", "-ltorch_npu", ',
        replace='f"-L{npu_root / \'lib\'}", ',
        tests=[T + "::test_ascend_build_depends_on_libtorch_npu_only_where_the_engine_calls_into_it"],
        why="under torch 2.10 the engine calls NPUStream::stream(): without the library, _C_npu fails to import "
        "with an undefined symbol",
    ),
    dict(
        name="install-banner-on-a-rebuild-that-compiles-nothing",
        file="setup_helpers/build_command.py",
        where="BuildWithSummary.run",
        find="        self.to_build = self.stale()\n",
        replace="        self.to_build = list(self.extensions)\n",
        tests=[T + "::test_a_rebuild_that_compiles_nothing_prints_no_banner"],
        why="every scripts/test.sh run prints the from-scratch banner and relinks every extension",
    ),
    dict(
        name="install-no-line-as-an-extension-starts",
        file="setup_helpers/build_command.py",
        where="BuildWithSummary.build_extension",
        find='        print(f"torch_kvswap: compiling the {label} ...", file=self.progress)\n',
        replace="",
        tests=[T + "::test_a_build_says_as_each_extension_starts_and_ends_with_its_elapsed_time"],
        why="minutes of silence while an extension compiles",
    ),
    dict(
        name="install-no-line-per-file-compiled",
        file="setup_helpers/build_command.py",
        where="CompileProgress._read",
        find="        for done, total in self.STATUS.findall(complete):\n",
        replace="        for done, total in self.STATUS.findall(b\"\"):\n",
        tests=[
            T + "::test_a_build_says_how_many_files_of_all_it_has_compiled",
            T + "::test_progress_says_each_status_line_once_as_the_log_grows",
        ],
        why="a 3-minute compile of the host engine says nothing between its first and last line",
    ),
    dict(
        name="install-one-object-folder-for-every-torch",
        file="setup_helpers/build_command.py",
        where="BuildWithSummary.finalize_options",
        find="        if keyed:\n",
        replace="        if False:\n",
        tests=[T + "::test_a_build_for_another_torch_in_the_clone_leaves_the_in_place_build_up_to_date"],
        why="`pip install .` from another venv overwrote the clone's objects and fingerprints: the next "
        "scripts/demo.sh compiled everything again (180 s)",
    ),
    dict(
        name="install-in-place-build-of-another-torch-looks-current",
        file="setup_helpers/build_command.py",
        where="BuildWithSummary.stale",
        find="        if in_place_torch != torch.__version__:\n",
        replace="        if False:\n",
        tests=[T + "::test_an_in_place_build_for_another_torch_compiles_again"],
        why="with objects per torch, an in-place build back on the earlier torch keeps the other torch's "
        "extension in the tree (it is newer than the sources and its own fingerprint matches)",
    ),
    dict(
        name="install-source-newer-than-extension-not-stale",
        file="setup_helpers/build_command.py",
        where="is_stale",
        find="os.stat(s).st_mtime > built",
        replace="os.stat(s).st_mtime > built + 1",
        tests=[T + "::test_an_extension_is_stale_when_its_file_is_missing_or_older_than_a_source"],
        why="a source saved within a second of the last build is not compiled",
    ),
    dict(
        name="install-core-header-not-a-dependency",
        file="setup.py",
        where="core_extension",
        find='depends=_headers(CSRC, CSRC / "core", CSRC / "host")',
        replace='depends=_headers(CSRC / "host")',
        tests=[T + "::test_every_file_an_extension_includes_is_a_dependency_so_changing_it_rebuilds"],
        why="a change to csrc/core/core.h alone leaves the host engine as it was",
    ),
    dict(
        name="install-changed-flags-not-rebuilt",
        file="setup_helpers/build_command.py",
        where="BuildWithSummary.stale",
        find='''or not self.stamp(e).is_file()
            or self.stamp(e).read_text() != self.fingerprints[e.name]
''',
        replace="or not self.stamp(e).is_file()\n",
        tests=[T + "::test_changed_compiler_flags_rebuild_an_extension_newer_than_its_sources"],
        why="a new torch, TORCH_CUDA_ARCH_LIST or KVSWAP_FAKE_COVERAGE keeps the extension built for the old one",
    ),
    dict(
        name="install-skipped-extension-copied-from-build",
        file="setup_helpers/build_command.py",
        where="copy_extensions_to_source",
        find="        self.extensions = [e for e in every if e in self.to_build]\n",
        replace="        self.extensions = list(every)\n",
        tests=["tests/test_install.py::test_a_rebuild_that_compiles_nothing_needs_no_copy_in_build"],
        why="an in-place build that compiled nothing failed once build/ had lost its copy of an "
        "extension (the wheel build drops the test fakes there), as CI's torch matrix step did",
    ),
    dict(
        name="mutation-fast-copies-only-the-engine",
        file="scripts/mutation_check.py",
        where="prepare_extension",
        find='        built = sorted((ROOT / "torch_kvswap").glob("_*.so"))\n',
        replace='        built = sorted((ROOT / "torch_kvswap").glob("_C*.so"))\n',
        tests=[
            "tests/test_mutation_check.py::"
            "test_a_python_only_run_copies_every_extension_of_the_tree_the_test_fake_included"
        ],
        why="the --fast run's copy has no test fake: a Python mutant's fake-CUDA tests skip and CI stops",
    ),
    dict(
        name="mutation-fork-keeps-the-harness-modules",
        file="scripts/mutation_check.py",
        where="run_pytest",
        find="                    if name != \"__main__\" and where and not where.startswith(installed):\n",
        replace="                    if False:\n",
        tests=[
            "tests/test_mutation_check.py::test_a_forked_test_run_is_a_fresh_pytest_in_the_copy_with_its_env"
        ],
        why="a test run forked from the harness imports the real tree's mutant_anchors (already "
        "imported there), not the copy's: a mutant of it survives",
    ),
    dict(
        name="mutation-fork-timeout-spares-the-children",
        file="scripts/mutation_check.py",
        where="run_pytest",
        find="                os.killpg(pid, signal.SIGKILL)\n",
        replace="                os.kill(pid, signal.SIGKILL)\n",
        tests=[
            "tests/test_mutation_check.py::"
            "test_a_forked_test_run_past_its_timeout_is_killed_with_its_children"
        ],
        why="a hung mutant's test run is killed but the processes it started keep running",
    ),
    dict(
        name="mutation-finished-run-leaves-its-processes",
        file="scripts/mutation_check.py",
        where="end_group",
        find="        os.killpg(pgid, signal.SIGKILL)\n",
        replace="        pass\n",
        tests=["tests/test_mutation_check.py::test_what_a_finished_test_run_left_running_is_ended[forked]"],
        why="processes a mutant's test run started (a multiprocessing forkserver, its resource "
        "tracker) outlive the check: CI found 15 of them, 2.2 GB, after its run",
    ),
    dict(
        name="mutation-copy-keeps-a-stale-build-lock",
        file="scripts/mutation_check.py",
        where="sync_tree",
        find="        lock.unlink()\n",
        replace="        pass\n",
        tests=[
            "tests/test_mutation_check.py::test_a_build_lock_left_in_the_copy_by_a_killed_check_is_removed"
        ],
        why="a check killed while the fake NPU built leaves torch's build lock in the copy: the next "
        "check's baseline waits on it until its timeout",
    ),
    dict(
        name="lint-skips-new-cpp-files",
        file="scripts/lint.sh",
        find="git ls-files --cached --others --exclude-standard '*.cpp'",
        replace="git ls-files '*.cpp'",
        tests=["tests/test_install.py::test_lint_checks_a_new_cpp_file_before_it_is_added_to_git"],
        why="a new C++ file passes the check by hand and fails CI's clean clone, where it is tracked",
    ),
]
