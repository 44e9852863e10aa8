"""Mutants of the GPU kit's own checks (scripts/gpu_report.py): each reverts one
finding of issue 26 (results that would not come back from the GPU machine,
goals printed but never judged, a sanitizer run that saw nothing) or breaks the
crossover the bench decides with. tests/test_gpu_kit.py pins each down."""

T = "tests/test_gpu_kit.py"
F = "scripts/gpu_report.py"

MUTANTS = [
    dict(
        name="gpukit-out-file-count-unchecked",
        file=F,
        where="check_out",
        find="    if len(files) > MAX_FILES:\n",
        replace="    if len(files) > MAX_FILES + 9:\n",
        tests=[T + "::test_more_than_six_files_are_refused"],
        why="the dry run left 15 files in $OUT; the device returns 8 and the summary may be among those lost",
    ),
    dict(
        name="gpukit-out-folders-allowed",
        file=F,
        where="check_out",
        find="        for d in sorted(dirnames):\n            problems.append(",
        replace="        for d in sorted(dirnames)[:0]:\n            problems.append(",
        tests=[T + "::test_folders_and_the_files_in_them_are_refused"],
        why="caches under $OUT/cache/... lie deeper than the device returns",
    ),
    dict(
        name="gpukit-ratio-goals-always-pass",
        file=F,
        where="ratio_goal",
        find='"verdict": "pass" if v >= target else "fail",',
        replace='"verdict": "pass",',
        tests=[T + "::test_each_goal_fails_where_its_number_falls_short"],
        why="the bench's goals were printed but never judged",
    ),
    dict(
        name="gpukit-sanitizer-skipped-tests-pass",
        file=F,
        where="judge_goals",
        find='"verdict": "pass" if clean and not unrun else "fail",',
        replace='"verdict": "pass" if clean else "fail",',
        tests=[T + "::test_the_sanitizer_goal_fails_when_its_tests_skipped_or_it_printed_no_summary"],
        why="a memcheck whose tests all skipped (no GPU seen) reads as clean",
    ),
    dict(
        name="gpukit-crossover-off-by-one-size",
        file=F,
        where="crossover",
        find="max([k for k in sizes if k < dma_from], default=0) < AUTO_THRESHOLD_KIB <= dma_from,",
        replace="max([k for k in sizes if k < dma_from], default=0) <= AUTO_THRESHOLD_KIB <= dma_from,",
        tests=[T + "::test_a_kernel_still_faster_at_the_threshold_disagrees_with_auto"],
        why="a crossover one size above auto's 32 KiB threshold reads as agreeing with it",
    ),
    dict(
        name="gpukit-other-venvs-read-as-the-kits-writes",
        file=F,
        where="tree_writes",
        find='if d not in OTHER_TOOLS and not os.path.exists(os.path.join(dirpath, d, "pyvenv.cfg"))',
        replace="if d not in OTHER_TOOLS",
        tests=["tests/test_gpu_kit.py::test_tree_writes_name_new_files_outside_the_build_outputs"],
        why="a venv that CI's other lane makes while the kit's dry run goes fails the run as the kit's write",
    ),
]
