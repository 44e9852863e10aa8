"""A stand-in accelerator and a recording engine, for tests on any machine.

``on_fake_device(t)`` returns a tensor on ``privateuseone:N`` (the dispatch key
PrivateUse1, the one the Ascend engine serves) whose memory is ``t``'s host
memory: the core routes a call with such tensors exactly as it routes an
accelerator's, and no kvswap engine serves that key unless a test registers
one. Only the kvswap ops are called on these tensors; any other op on them
fails (no kernels), which is fine for what they are for.

``engine_spy(key)`` installs, for the duration of a ``with`` block, a
recording engine in the core in place of the engine of ``key`` ("CPU" stands
in for the host engine, "PrivateUse1" adds an engine for the stand-in device;
tests/fake_cuda/test_extension.cpp). It records every call (descriptors,
direction code, device) and, unless told not to, performs the copies with
``memmove``, so a test sees both what the core handed an engine and the bytes
that result.
"""

from __future__ import annotations

import contextlib
import ctypes
import types
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

import torch_kvswap
from torch_kvswap._build_shared import release

# --- the stand-in device ------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

_KDL_EXT_DEV = 12  # DLPack's "extension device": torch maps it to PrivateUse1
_DL_INT, _DL_UINT, _DL_FLOAT = 0, 1, 2
_alive: dict[int, tuple] = {}  # what each handed-out tensor's memory depends on


@_DELETER
def _free_dlpack_tensor(managed) -> None:
    _alive.pop(ctypes.addressof(managed.contents), None)


def fake_device_or_skip() -> None:
    """Makes privateuseone usable as a stand-in device, or skips the test."""
    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        pytest.skip(
            "a real PrivateUse1 backend is registered "
            f"({torch._C._get_privateuse1_backend_name()}); no stand-in device"
        )
    if torch_kvswap.ENGINES["npu"]:
        pytest.skip("the Ascend engine serves PrivateUse1; no stand-in device")
    if not hasattr(torch, "privateuseone"):
        # Creating a tensor on a device initializes its Python module first.
        module = types.ModuleType("torch.privateuseone")
        module._lazy_init = lambda: None
        module.is_available = lambda: True
        module.is_initialized = lambda: True
        module.device_count = lambda: 2
        module.current_device = lambda: 0
        module._is_in_bad_fork = lambda: False  # torch.manual_seed asks every device module
        module.manual_seed_all = lambda seed: None
        torch._register_device_module("privateuseone", module)


def on_fake_device(host: torch.Tensor, index: int = 0) -> torch.Tensor:
    """A ``privateuseone:index`` tensor over ``host``'s memory (same shape and strides)."""
    fake_device_or_skip()
    code = _DL_FLOAT if host.is_floating_point() else (_DL_INT if host.dtype.is_signed else _DL_UINT)
    shape = (ctypes.c_int64 * host.dim())(*host.shape)
    strides = (ctypes.c_int64 * host.dim())(*host.stride())
    managed = _DLManagedTensor()
    managed.dl_tensor.data = host.data_ptr()
    managed.dl_tensor.device = _DLDevice(_KDL_EXT_DEV, index)
    managed.dl_tensor.ndim = host.dim()
    managed.dl_tensor.dtype = _DLDataType(code, host.element_size() * 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = strides
    managed.deleter = _free_dlpack_tensor
    _alive[ctypes.addressof(managed)] = (host, shape, strides, managed)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    try:
        out = torch._C._from_dlpack(new_capsule(ctypes.addressof(managed), b"dltensor", None))
    except Exception as exc:
        if release(torch.__version__)[:2] >= (2, 13):  # the release CI runs: the stand-in must work
            raise
        pytest.skip(f"torch {torch.__version__} cannot make the stand-in device: {exc}")
    assert out.device == torch.device("privateuseone", index) and out.data_ptr() == host.data_ptr()
    return out


# --- the recording engine ------------------------------------------------------


@dataclass
class Submission:
    """One call of an engine's submit, as the engine receives it."""

    src: list[int]
    dst: list[int]
    sizes: list[int]
    direction: int
    total_bytes: int
    device: torch.device


class _Calls(Sequence):
    """The recording engine's calls so far, read from it on each look; once
    the engine is uninstalled, the calls it recorded."""

    frozen: list[Submission] | None = None

    def _all(self) -> list[Submission]:
        if self.frozen is not None:
            return self.frozen
        tables, directions, totals, devices = torch.ops.kvswap_test.spy_calls()
        return [
            Submission(t[0].tolist(), t[1].tolist(), t[2].tolist(), d, n, torch.device(dev))
            for t, d, n, dev in zip(tables, directions, totals, devices)
        ]

    def __getitem__(self, i):
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._all())

    def __eq__(self, other) -> bool:
        return self._all() == list(other)

    def __repr__(self) -> str:
        return repr(self._all())


_ENGINE_OF_KEY = {"CPU": "cpu", "PrivateUse1": "privateuseone"}


@contextlib.contextmanager
def engine_spy(key: str, copy: bool = True):
    """Serves the device type of dispatch key ``key`` with a recording engine; yields its calls."""
    import extension_ops  # noqa: F401 - torch.ops.kvswap_test

    torch.ops.kvswap_test.spy_install(_ENGINE_OF_KEY[key], copy)
    calls = _Calls()
    try:
        yield calls
    finally:
        calls.frozen = calls._all()
        torch.ops.kvswap_test.spy_uninstall()
