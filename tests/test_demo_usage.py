"""The demo's options: each one out of its range, or a combination that
cannot run, stops at parse time with argparse's usage error (exit status 2)
naming the option, what was given and what is accepted; nothing is allocated
first. Each limit is tested at its largest accepted value and one past it."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch

from torch_kvswap.bench import demo

# A 1,024-byte cache (2**-20 GiB) of one-byte blocks (one token, one head of
# one int8 element), one device block per host block, one job moving every
# block: each size option's limit is a number worked out by hand below.
TINY = [
    "--cache-gib",
    repr(2**-20),
    "--layers",
    "1",
    "--kv-heads",
    "1",
    "--head-dim",
    "1",
    "--block-tokens",
    "1",
    "--dtype",
    "int8",
    "--factor",
    "1",
    "--jobs",
    "1",
    "--offload-fraction",
    "1",
    "--device",
    "cpu",
]


def refusal(capsys, argv) -> str:
    """The error line of a refused command line (exit status 2, after usage)."""
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m torch_kvswap.bench.demo"), err
    return err.splitlines()[-1]


@pytest.fixture
def no_accelerator(monkeypatch):
    monkeypatch.setattr(demo, "accelerator", lambda: None)


@pytest.fixture
def two_cuda_devices(monkeypatch):
    monkeypatch.setattr(demo, "accelerator", lambda: ("cuda", 2))


# ---------------------------------------------------------------- one option out of its range


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("--layers", "0", "an integer >= 1"),
        ("--layers", "-3", "an integer >= 1"),
        ("--layers", "2.5", "an integer >= 1"),
        ("--kv-heads", "-2", "an integer >= 1"),
        ("--kv-heads", "eight", "an integer >= 1"),
        ("--head-dim", "0", "an integer >= 1"),
        ("--head-dim", "1e2", "an integer >= 1"),
        ("--block-tokens", "0", "an integer >= 1"),
        ("--block-tokens", "", "an integer >= 1"),
        ("--cache-gib", "0", "a finite number > 0"),
        ("--cache-gib", "-1", "a finite number > 0"),
        ("--cache-gib", "nan", "a finite number > 0"),
        ("--cache-gib", "inf", "a finite number > 0"),
        ("--cache-gib", "1GiB", "a finite number > 0"),
        ("--factor", "0", "an integer >= 1"),
        ("--factor", "-1", "an integer >= 1"),
        ("--offload-fraction", "0", "a fraction in (0, 1]"),
        ("--offload-fraction", "-0.5", "a fraction in (0, 1]"),
        ("--offload-fraction", "1.5", "a fraction in (0, 1]"),
        ("--offload-fraction", "half", "a fraction in (0, 1]"),
        ("--jobs", "0", "an integer >= 1"),
        ("--jobs", "two", "an integer >= 1"),
        ("--seed", "-1", "an integer in [0, 2**64)"),
        ("--seed", "x", "an integer in [0, 2**64)"),
    ],
)
def test_an_option_out_of_its_range_is_a_usage_error(capsys, option, value, expected):
    line = refusal(capsys, [option, value])
    assert (
        line
        == f"python -m torch_kvswap.bench.demo: error: argument {option}: expected {expected}, got {value}"
    )


def test_a_dtype_not_offered_is_a_usage_error_listing_the_choices(capsys):
    line = refusal(capsys, ["--dtype", "float64"])
    assert line.endswith(
        "argument --dtype: invalid choice: 'float64' (choose from bfloat16, float16, float32, int8)"
    ) or line.endswith(
        "argument --dtype: invalid choice: 'float64' (choose from 'bfloat16', 'float16', 'float32', 'int8')"
    ), line


@pytest.mark.parametrize(
    "option, largest, past",
    [
        ("--offload-fraction", "1", repr(math.nextafter(1.0, 2.0))),
        ("--seed", str(2**64 - 1), str(2**64)),  # torch.Generator.manual_seed's range
    ],
)
def test_a_bounded_option_takes_its_largest_value_and_refuses_the_next(capsys, option, largest, past):
    assert demo.parse_args([*TINY, option, largest]).plan.num_blocks == 512
    assert f"argument {option}: expected " in refusal(capsys, [*TINY, option, past])


def test_the_smallest_values_are_accepted():
    args = demo.parse_args([*TINY, "--seed", "0"])
    assert (
        args.layers,
        args.kv_heads,
        args.head_dim,
        args.block_tokens,
        args.factor,
        args.jobs,
        args.seed,
    ) == (1, 1, 1, 1, 1, 1, 0)


# ---------------------------------------------------------------- --device


@pytest.mark.parametrize("value", ["bogus", "cuda", "cuda:0", "cuda:-1", "meta", "cpu:1", "xpu", ""])
def test_a_device_torch_cannot_use_is_a_usage_error(capsys, no_accelerator, value):
    line = refusal(capsys, ["--device", value])
    assert line.endswith(f"argument --device: expected cpu (torch finds no accelerator here), got {value}"), (
        line
    )


@pytest.mark.parametrize(
    "value, device", [("cpu", "cpu"), ("cpu:0", "cpu:0"), ("cuda", "cuda"), ("cuda:1", "cuda:1")]
)
def test_cpu_and_the_accelerators_devices_are_accepted(two_cuda_devices, value, device):
    assert demo.device_option(value) == torch.device(device)


@pytest.mark.parametrize("value", ["cuda:2", "xpu:0", "mps"])
def test_a_device_past_the_accelerators_count_or_of_another_kind_is_refused(capsys, two_cuda_devices, value):
    line = refusal(capsys, ["--device", value])
    assert line.endswith(f"argument --device: expected cpu, cuda or cuda:0 to cuda:1, got {value}"), line


# ---------------------------------------------------------------- options that must fit --cache-gib together


# 1,024 bytes hold 1024 // (2 * layers * bytes per block) blocks per tensor;
# one job needs one host block of --factor device blocks.
@pytest.mark.parametrize(
    "option, largest, extra",
    [
        ("--layers", 512, []),  # 1024 // (2 * 512) = 1 block per tensor
        ("--kv-heads", 512, []),  # blocks of 512 bytes: 1 per tensor
        ("--head-dim", 512, []),
        ("--block-tokens", 512, []),
        ("--kv-heads", 128, ["--dtype", "float32"]),  # 128 heads x 4 bytes
        ("--factor", 512, []),  # 512 blocks per tensor make one host block of 512
        ("--jobs", 512, []),  # 512 host blocks of one device block
    ],
)
def test_a_size_option_fits_the_cache_up_to_its_largest_value(capsys, option, largest, extra):
    assert demo.parse_args([*TINY, *extra, option, str(largest)]).plan.host_blocks >= 1
    line = refusal(capsys, [*TINY, *extra, option, str(largest + 1)])
    assert f"{option} {largest + 1}" in line and "raise --cache-gib to at least " in line, line


def test_the_offload_fraction_must_leave_one_host_block_per_job(capsys):
    # 512 blocks per tensor: 1/512 of them is one block, anything less none.
    assert demo.parse_args([*TINY, "--offload-fraction", repr(1 / 512)]).plan.host_blocks == 1
    below = repr(math.nextafter(1 / 512, 0.0))
    line = refusal(capsys, [*TINY, "--offload-fraction", below])
    assert "holds 512 device blocks" in line and f"--offload-fraction {float(below):g}" in line, line


def test_the_cache_must_hold_one_block_of_each_tensor(capsys):
    # Two tensors of one-byte blocks: 2 bytes, 2**-29 GiB.
    assert demo.parse_args([*TINY, "--cache-gib", repr(2**-29)]).plan.num_blocks == 1
    line = refusal(capsys, [*TINY, "--cache-gib", repr(math.nextafter(2**-29, 0.0))])
    assert "holds 0 device blocks in each of 2 K/V tensors" in line, line


def test_too_many_layers_for_the_cache_names_both_and_is_refused_before_building(capsys):
    line = refusal(capsys, ["--layers", "20000", "--device", "cpu"])
    assert (
        "--cache-gib 1 holds 0 device blocks in each of 40000 K/V tensors (--layers 20000) of 32768-byte "
        "blocks (--block-tokens 16 x --kv-heads 8 x --head-dim 128 x 2-byte bfloat16); --jobs 4 needs 4 host "
        "blocks of --factor 2 device blocks from --offload-fraction 0.5 of them, so 16 per tensor: raise "
        "--cache-gib to at least 19.54,"
    ) in line, line  # 16 x 40000 x 32 KiB = 19.53125 GiB


@pytest.mark.parametrize(
    "argv",
    [
        ["--layers", "20000"],
        ["--cache-gib", "0.001", "--layers", "2", "--jobs", "64"],
        [*TINY, "--offload-fraction", "0.001"],
        [*TINY, "--factor", "7", "--jobs", "100", "--offload-fraction", "0.3"],
    ],
)
def test_the_cache_size_a_refusal_names_is_accepted(capsys, argv, monkeypatch):
    monkeypatch.setattr(demo, "free_bytes", lambda device: None)  # this test is about fitting, not memory
    line = refusal(capsys, [*argv, "--device", "cpu"])
    least = re.search(r"raise --cache-gib to at least ([0-9.e+-]+),", line).group(1)
    assert demo.parse_args([*argv, "--device", "cpu", "--cache-gib", least]).plan.host_blocks >= 1


# ---------------------------------------------------------------- memory


def test_the_run_fits_in_exactly_the_free_host_memory(capsys, monkeypatch):
    # On the CPU: the cache (1,024) + its host mirror (1,024 + 4,096 padding
    # per tensor and one more: 13,312) + the copy checked against (1,024) +
    # one layer's random contents (1,024) = 16,384 bytes.
    monkeypatch.setattr(demo, "free_bytes", lambda device: 16384)
    assert demo.parse_args(TINY).plan.cache_bytes == 1024
    monkeypatch.setattr(demo, "free_bytes", lambda device: 16383)
    line = refusal(capsys, TINY)
    assert (
        f"--cache-gib {2**-20:g} needs " in line
        and " GiB of host memory (the cache, its host mirror and a copy to check it against)" in line
        and "lower --cache-gib to at most about " in line
    ), line


def test_the_cache_fits_in_exactly_the_free_accelerator_memory(capsys, monkeypatch, two_cuda_devices):
    free = {"cpu": 15360, "cuda": 1024}  # the host needs the CPU case's 16,384 less the cache
    monkeypatch.setattr(demo, "free_bytes", lambda device: free[device.type])
    assert demo.parse_args([*TINY, "--device", "cuda:1"]).device == torch.device("cuda:1")
    free["cuda"] = 1023
    line = refusal(capsys, [*TINY, "--device", "cuda:1"])
    assert " GiB of cuda:1 memory (the cache), and " in line and "--offload-fraction" not in line, line
    free["cuda"], free["cpu"] = 1024, 15359
    line = refusal(capsys, [*TINY, "--device", "cuda:1"])
    assert " GiB of host memory (the cache's host mirror and a copy to check it against)" in line, line


def test_a_cache_beyond_this_machines_memory_is_refused(capsys):
    line = refusal(capsys, ["--cache-gib", "1e9", "--device", "cpu"])  # an exbibyte
    assert (
        line.startswith("python -m torch_kvswap.bench.demo: error: --cache-gib 1e+09 needs ")
        and "of host memory" in line
    ), line


# ---------------------------------------------------------------- the command itself


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--device", "bogus"], "argument --device: expected cpu"),
        (
            ["--layers", "20000"],
            "--cache-gib 1 holds 0 device blocks in each of 40000 K/V tensors (--layers 20000)",
        ),
    ],
)
def test_the_command_refuses_before_building_anything(argv, says):
    proc = subprocess.run(
        [sys.executable, "-m", "torch_kvswap.bench.demo", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc
    assert proc.stdout == ""  # nothing built, nothing printed
    assert proc.stderr.splitlines()[-1].startswith("python -m torch_kvswap.bench.demo: error: " + says), (
        proc.stderr
    )
