"""Argument validation of the MLA functions (flashmla_cupy/checks.py), with and without a GPU.

``CASES`` is a table of calls of ``get_mla_metadata`` and ``flash_mla_with_kvcache`` with one
wrong argument each. Each row names the exception and words of its message: the message must
start with the first word (the argument's name) and contain all of them (what was expected and
what was given).

On the CPU the calls get CuPy array headers over made-up device memory (tests/fake_arrays.py) and
a fake Hopper GPU (``FakeGPU``): CuPy's current device and stream, the device properties, the
memory type behind a pointer and ``cupy.asnumpy`` (which serves the NumPy values the test prepared)
are monkeypatched, and so are the launch layer, which records what would be launched (every row
also asserts that nothing was), and the error record (``errors.record``: ``FakeRecord``, in
ordinary host memory). On a Hopper GPU the rows that need no fake run on real arrays, floating
ones (the ``out`` and ``lse`` buffers among them) poisoned with NaN, and assert that no
argument's bits changed.

The value checks' host side (errors.py: modes, the environment variable, messages, the record's
report-once semantics, when a call synchronizes) is tested on the CPU too; the kernels' side is
in tests/test_values.py.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import cupy
import numpy as np
import pytest

import flashmla_cupy
from fake_arrays import A100, FAKE_ADDRESS, FAKE_SPAN, H100, HostCudaArrayInterface, HostDLPack, fake_array
from flashmla_cupy import attention, checks, compiler, constants, driver, errors, launch, mla, programs, scheduler

REPO = Path(__file__).resolve().parents[1]
B, S_Q, H_Q, H_KV, NUM_BLOCKS = 2, 1, 16, 1, 4
Q_ROWS = S_Q * H_Q // H_KV
SEQLENS = np.array([100, 64], np.int32)                    # 2 pages and 1 page
BLOCK_TABLE = np.array([[0, 1], [2, 3]], np.int32)         # room for 128 tokens per request
BF16 = checks.bfloat16()
F16, F32, I32, I64 = np.float16, np.float32, np.int32, np.int64


# --------------------------------------------------------------------------------------------
# Arguments: valid ones, built on fake or on real device memory
# --------------------------------------------------------------------------------------------

class FakeArrays:
    """Array headers over made-up device memory; ``values`` arrays have host copies that the
    fake ``cupy.asnumpy`` returns."""

    sm_count = H100["sm_count"]

    def __init__(self):
        self.host = {}

    def empty(self, shape, dtype, step=1, offset=0, device=0):
        return fake_array(shape, dtype, step=step, offset=offset, device=device)

    def values(self, host: np.ndarray):
        arr = fake_array(host.shape, host.dtype)
        self.host[id(arr)] = host
        return arr

    def metadata(self, seqlens):
        parts = scheduler.num_sm_parts(self.sm_count, Q_ROWS, H_KV)
        return self.empty((parts, scheduler.SCHED_META_INTS), I32), self.empty((seqlens.shape[0] + 1,), I32)


class DeviceArrays:
    """Real arrays on the current GPU: floating ones full of NaN, integer ones zero."""

    def __init__(self):
        self.sm_count = driver.device_properties(cupy.cuda.runtime.getDevice())["sm_count"]

    def empty(self, shape, dtype, step=1, offset=0):
        """Like ``FakeArrays.empty``: the last axis ``step`` elements apart, ``offset`` elements
        past an aligned address."""
        wide = tuple(shape[:-1]) + (shape[-1] * step,)
        size = int(np.prod(wide))
        fill = 0 if np.dtype(dtype).kind in "iu" else np.nan
        base = cupy.full(size + offset, fill, dtype=F32).astype(dtype)
        return base[offset:].reshape(wide)[..., ::step]

    def values(self, host: np.ndarray):
        return cupy.asarray(host)

    def metadata(self, seqlens):
        return flashmla_cupy.get_mla_metadata(seqlens, Q_ROWS, H_KV)


def mla_args(arrays) -> dict:
    seqlens = arrays.values(SEQLENS)
    metadata, num_splits = arrays.metadata(seqlens)
    return dict(q=arrays.empty((B, S_Q, H_Q, 576), BF16), k_cache=arrays.empty((NUM_BLOCKS, 64, H_KV, 576), BF16),
                block_table=arrays.values(BLOCK_TABLE), cache_seqlens=seqlens, head_dim_v=512,
                tile_scheduler_metadata=metadata, num_splits=num_splits, softmax_scale=None, causal=False,
                out=arrays.empty((B, S_Q, H_Q, 512), BF16), lse=arrays.empty((B, H_Q, S_Q), F32))


def metadata_args(arrays) -> dict:
    return dict(cache_seqlens=arrays.values(SEQLENS), num_heads_per_head_k=Q_ROWS, num_heads_k=H_KV)


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

MLA = flashmla_cupy.flash_mla_with_kvcache
METADATA = flashmla_cupy.get_mla_metadata


@dataclass
class Case:
    id: str
    edit: Callable[[dict, object], None]   # (arguments, arrays): put the wrong argument in
    error: type
    words: tuple                           # the message starts with words[0] and contains all;
                                           # a callable word is called with the arrays' sm_count
    fn: Callable = MLA
    cpu_only: bool = False                 # needs the fake GPU: another device or architecture
    props: dict = field(default_factory=lambda: H100)


def arg(name, make):
    """An edit that makes argument ``name`` ``make(arrays)``."""
    def edit(args, arrays):
        args[name] = make(arrays)
    return edit


def row(id, name, make, error, *words, **options) -> Case:
    """A case whose argument ``name`` is ``make(arrays)``; its message starts with ``name``."""
    return Case(id, arg(name, make), error, (name, *words), **options)


def q_shape(b=B, s_q=S_Q, h_q=H_Q, d=576):
    return lambda a: a.empty((b, s_q, h_q, d), BF16)


def cache_shape(blocks=NUM_BLOCKS, page=64, h_kv=H_KV, d=576):
    return lambda a: a.empty((blocks, page, h_kv, d), BF16)


CASES = [
    # Not a GPU array, or on another device
    row("q-numpy", "q", lambda a: np.zeros((B, S_Q, H_Q, 576), F16), TypeError,
        "must be a GPU array", "NumPy array in host memory"),
    row("k_cache-host-dlpack", "k_cache", lambda a: HostDLPack(1), TypeError,
        "must be a GPU array", "HostDLPack whose DLPack device type is 1"),
    row("k_cache-pinned-dlpack", "k_cache", lambda a: HostDLPack(3), TypeError,
        "must be a GPU array", "DLPack device type is 3"),
    row("block_table-host-cuda-array-interface", "block_table", lambda a: HostCudaArrayInterface(), TypeError,
        "must be a GPU array", "__cuda_array_interface__ points to host memory"),
    row("cache_seqlens-list", "cache_seqlens", lambda a: [100, 64], TypeError, "must be a GPU array", "builtins.list"),
    row("num_splits-none", "num_splits", lambda a: None, TypeError, "must be a GPU array", "NoneType"),
    row("tile_scheduler_metadata-other-device", "tile_scheduler_metadata",
        lambda a: a.empty((a.sm_count, 8), I32, device=1), ValueError,
        "must be on CuPy's current device 0", "on device 1", cpu_only=True),
    row("out-other-device", "out", lambda a: a.empty((B, S_Q, H_Q, 512), BF16, device=1), ValueError,
        "must be on CuPy's current device 0", "on device 1", cpu_only=True),
    # dtypes
    row("q-float32", "q", lambda a: a.empty((B, S_Q, H_Q, 576), F32), TypeError,
        "must have dtype bfloat16 or float16", "got float32"),
    row("k_cache-not-q-dtype", "k_cache", lambda a: a.empty((NUM_BLOCKS, 64, H_KV, 576), F16), TypeError,
        "must have q's dtype bfloat16", "got float16"),
    row("block_table-int64", "block_table", lambda a: a.values(BLOCK_TABLE.astype(I64)), TypeError,
        "must have dtype int32", "got int64"),
    row("cache_seqlens-int64", "cache_seqlens", lambda a: a.values(SEQLENS.astype(I64)), TypeError,
        "must have dtype int32", "got int64"),
    row("tile_scheduler_metadata-int64", "tile_scheduler_metadata", lambda a: a.empty((a.sm_count, 8), I64),
        TypeError, "must have dtype int32", "got int64"),
    row("num_splits-int64", "num_splits", lambda a: a.empty((B + 1,), I64), TypeError,
        "must have dtype int32", "got int64"),
    # ranks and sizes
    row("q-3d", "q", lambda a: a.empty((B, H_Q, 576), BF16), ValueError, "must be 4-D", "got 3-D shape (2, 16, 576)"),
    row("k_cache-3d", "k_cache", lambda a: a.empty((NUM_BLOCKS * 64, H_KV, 576), BF16), ValueError,
        "must be 4-D", "got 3-D shape (256, 1, 576)"),
    row("block_table-1d", "block_table", lambda a: a.values(BLOCK_TABLE.ravel()), ValueError,
        "must be 2-D", "got 1-D shape (4,)"),
    row("cache_seqlens-2d", "cache_seqlens", lambda a: a.values(SEQLENS[:, None]), ValueError,
        "must be 1-D", "got 2-D shape (2, 1)"),
    row("q-head-dim-512", "q", q_shape(d=512), ValueError, "must have head dim (axis 3) 576", "(2, 1, 16, 512)"),
    row("k_cache-head-dim-512", "k_cache", cache_shape(d=512), ValueError,
        "must have head dim (axis 3) 576", "(4, 64, 1, 512)"),
    row("head_dim_v-576", "head_dim_v", lambda a: 576, ValueError, "must be 512", "got 576"),
    row("head_dim_v-str", "head_dim_v", lambda a: "512", TypeError, "must be an int", "str '512'"),
    row("k_cache-page-48", "k_cache", cache_shape(page=48), ValueError,
        "must have a power-of-two page block size (axis 1", "(4, 48, 1, 576)"),
    row("k_cache-page-0", "k_cache", cache_shape(page=0), ValueError,
        "at least one block (axis 0) of at least one token (axis 1)", "(4, 0, 1, 576)"),
    Case("q-heads-not-multiple-of-kv-heads", arg("k_cache", cache_shape(h_kv=3)), ValueError,
         ("q", "must have a positive multiple of k_cache's 3 heads", "(2, 1, 16, 576)")),
    row("q-s_q-0", "q", q_shape(s_q=0), ValueError, "at least one query token", "(2, 0, 16, 576)"),
    row("q-batch-0", "q", q_shape(b=0), ValueError, "at least one request", "(0, 1, 16, 576)"),
    row("k_cache-no-blocks", "k_cache", cache_shape(blocks=0), ValueError, "at least one block", "(0, 64, 1, 576)"),
    row("block_table-3-rows", "block_table", lambda a: a.values(np.zeros((3, 2), I32)), ValueError,
        "one row per request (2)", "(3, 2)"),
    row("cache_seqlens-3-entries", "cache_seqlens", lambda a: a.values(np.zeros(3, I32)), ValueError,
        "must have shape (2,)", "got (3,)"),
    # layout
    row("q-last-dim-strided", "q", lambda a: a.empty((B, S_Q, H_Q, 576), BF16, step=2), ValueError,
        "must be contiguous in its last dimension (stride 2 bytes)", "strides (36864, 36864, 2304, 4)"),
    row("k_cache-last-dim-strided", "k_cache", lambda a: a.empty((NUM_BLOCKS, 64, H_KV, 576), BF16, step=2),
        ValueError, "must be contiguous in its last dimension", "strides (147456, 2304, 2304, 4)"),
    row("block_table-last-dim-strided", "block_table", lambda a: a.empty((B, 2), I32, step=2), ValueError,
        "must be contiguous in its last dimension", "strides (16, 8)"),
    row("cache_seqlens-strided", "cache_seqlens", lambda a: a.empty((B,), I32, step=3), ValueError,
        "must be C-contiguous", "strides (12,)"),
    row("tile_scheduler_metadata-strided", "tile_scheduler_metadata", lambda a: a.empty((a.sm_count, 8), I32, step=2),
        ValueError, "must be C-contiguous", "strides (64, 8)"),
    row("num_splits-strided", "num_splits", lambda a: a.empty((B + 1,), I32, step=2), ValueError,
        "must be C-contiguous", "strides (8,)"),
    row("k_cache-misaligned", "k_cache", lambda a: a.empty((NUM_BLOCKS, 64, H_KV, 576), BF16, offset=1), ValueError,
        "must start on a 16-byte boundary", "address 0x"),
    row("q-misaligned", "q", lambda a: a.empty((B, S_Q, H_Q, 576), BF16, offset=1), ValueError,
        "must start on a 16-byte boundary", "address 0x"),
    # metadata of another batch or head layout
    row("tile_scheduler_metadata-of-128-heads", "tile_scheduler_metadata",
        lambda a: a.empty((scheduler.num_sm_parts(a.sm_count, 128, 1), 8), I32), ValueError,
        lambda sm_count: f"must have shape ({scheduler.num_sm_parts(sm_count, Q_ROWS, H_KV)}, 8)",
        "s_q * h_q // h_kv = 16, h_kv = 1",
        lambda sm_count: f"got ({scheduler.num_sm_parts(sm_count, 128, 1)}, 8)"),
    row("num_splits-of-batch-3", "num_splits", lambda a: a.empty((4,), I32), ValueError,
        "must have shape (3,)", "got (4,)"),
    # scalars
    row("softmax_scale-0", "softmax_scale", lambda a: 0.0, ValueError, "must be positive and finite", "got 0.0"),
    row("softmax_scale-negative", "softmax_scale", lambda a: -0.1, ValueError, "must be positive", "got -0.1"),
    row("softmax_scale-nan", "softmax_scale", lambda a: float("nan"), ValueError, "finite in float32", "got nan"),
    row("softmax_scale-str", "softmax_scale", lambda a: "0.1", TypeError, "must be a real number", "str '0.1'"),
    row("causal-str", "causal", lambda a: "false", TypeError, "must be a bool", "str 'false'"),
    row("causal-int", "causal", lambda a: 1, TypeError, "must be a bool", "int 1"),
    # outputs
    row("out-numpy", "out", lambda a: np.zeros((B, S_Q, H_Q, 512), F16), TypeError, "NumPy array in host memory"),
    row("out-shape-576", "out", lambda a: a.empty((B, S_Q, H_Q, 576), BF16), ValueError,
        "must have shape (2, 1, 16, 512)", "got (2, 1, 16, 576)"),
    row("out-float16", "out", lambda a: a.empty((B, S_Q, H_Q, 512), F16), TypeError,
        "must have dtype bfloat16", "got float16"),
    row("out-strided", "out", lambda a: a.empty((B, S_Q, H_Q, 512), BF16, step=2), ValueError,
        "must be C-contiguous", "strides (32768, 32768, 2048, 4)"),
    row("out-misaligned", "out", lambda a: a.empty((B, S_Q, H_Q, 512), BF16, offset=4), ValueError,
        "must start on a 16-byte boundary", "(the kernels write it 16 bytes at a time)"),
    row("lse-shape-of-out-layout", "lse", lambda a: a.empty((B, S_Q, H_Q), F32), ValueError,
        "must have shape (2, 16, 1)", "got (2, 1, 16)"),
    row("lse-bfloat16", "lse", lambda a: a.empty((B, H_Q, S_Q), BF16), TypeError,
        "must have dtype float32", "got bfloat16"),
    # the device
    Case("mla-on-a100", lambda args, arrays: None, flashmla_cupy.UnsupportedDeviceError,
         ("the current device must be a Hopper GPU", "NVIDIA A100-SXM4-80GB (sm_80)"), cpu_only=True, props=A100),
    # get_mla_metadata
    row("metadata-cache_seqlens-numpy", "cache_seqlens", lambda a: SEQLENS.copy(), TypeError,
        "must be a GPU array", "NumPy array in host memory", fn=METADATA),
    row("metadata-cache_seqlens-int64", "cache_seqlens", lambda a: a.values(SEQLENS.astype(I64)), TypeError,
        "must have dtype int32", "got int64", fn=METADATA),
    row("metadata-cache_seqlens-2d", "cache_seqlens", lambda a: a.values(SEQLENS[None]), ValueError,
        "must be 1-D [batch]", "got 2-D shape (1, 2)", fn=METADATA),
    row("metadata-batch-0", "cache_seqlens", lambda a: a.values(np.zeros(0, I32)), ValueError,
        "at least one request", "got shape (0,)", fn=METADATA),
    row("metadata-cache_seqlens-strided", "cache_seqlens", lambda a: a.empty((B,), I32, step=2), ValueError,
        "must be C-contiguous", "strides (8,)", fn=METADATA),
    row("metadata-cache_seqlens-other-device", "cache_seqlens", lambda a: a.empty((B,), I32, device=1), ValueError,
        "must be on CuPy's current device 0", "on device 1", fn=METADATA, cpu_only=True),
    row("metadata-num_heads_k-0", "num_heads_k", lambda a: 0, ValueError, "must be >= 1", "got 0", fn=METADATA),
    row("metadata-num_heads_per_head_k-0", "num_heads_per_head_k", lambda a: 0, ValueError,
        "must be >= 1", "got 0", fn=METADATA),
    row("metadata-num_heads_per_head_k-float", "num_heads_per_head_k", lambda a: 16.0, TypeError,
        "must be an int", "float 16.0", fn=METADATA),
    Case("metadata-on-a100", lambda args, arrays: None, flashmla_cupy.UnsupportedDeviceError,
         ("the current device must be a Hopper GPU", "NVIDIA A100-SXM4-80GB (sm_80)"), fn=METADATA, cpu_only=True,
         props=A100),
]
GPU_CASES = [c for c in CASES if not c.cpu_only]


def call_args(case: Case, arrays) -> dict:
    args = metadata_args(arrays) if case.fn is METADATA else mla_args(arrays)
    case.edit(args, arrays)
    return args


def check_message(case: Case, error: Exception, sm_count: int) -> None:
    message = str(error)
    words = [w(sm_count) if callable(w) else w for w in case.words]
    assert message.startswith(words[0]), f"message does not start with {words[0]!r}: {message}"
    missing = [w for w in words if w not in message]
    assert not missing, f"message lacks {missing}: {message}"


# --------------------------------------------------------------------------------------------
# The fake GPU (CPU tests)
# --------------------------------------------------------------------------------------------

class FakeLaunch:
    """``launch.Launch`` without a GPU: a real parameter struct; calls are recorded."""

    def __init__(self, params_type, launches: list):
        self.buffer = bytearray(ctypes.sizeof(params_type))
        self.params = params_type.from_buffer(self.buffer)
        self.params_address = ctypes.addressof(self.params)
        self._launches = launches

    def __call__(self):
        self._launches.append(self)


class FakeKernel:
    """``launch.Kernel`` without a GPU: launches are recorded, nothing is compiled."""

    def __init__(self, launches: list, program, name_expression=None):
        self._launches = launches
        self.program = program
        self.name_expression = name_expression or program.kernels[0]

    def prepare(self, grid, block, params_type, **options):
        launch = FakeLaunch(params_type, self._launches)
        launch.grid, launch.block, launch.options, launch.program = grid, block, options, self.program
        launch.kernel = self.name_expression
        return launch

    def launch(self, grid, block, params, **options):
        self._launches.append(params)


_REAL_GET_KERNEL = launch.get_kernel


class FakeGPU:
    """A GPU for code that reads array headers only: see the module docstring."""

    def __init__(self, monkeypatch):
        self.arrays = FakeArrays()
        self.props = H100
        self.capturing = False
        self.launches = []
        stream = types.SimpleNamespace(ptr=0, is_capturing=lambda: self.capturing)
        monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
        monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: stream)
        monkeypatch.setattr(cupy.cuda.runtime, "pointerGetAttributes", self.pointer_attributes)
        monkeypatch.setattr(cupy, "asnumpy", lambda arr: self.arrays.host[id(arr)])
        monkeypatch.setattr(driver, "device_properties", lambda device_id: self.props)
        monkeypatch.setattr(launch, "get_kernel", lambda program, name_expression=None, *args, **kwargs:
                            FakeKernel(self.launches, program, name_expression))
        monkeypatch.setattr(errors, "record", lambda device_id: FakeRecord())
        monkeypatch.setattr(mla, "_plans", OrderedDict())     # plans built on fakes must not outlive the test
        monkeypatch.setattr(mla, "_metadata_launches", {})

    @staticmethod
    def pointer_attributes(address: int):
        rt = cupy.cuda.runtime
        on_device = FAKE_ADDRESS <= address < FAKE_ADDRESS + FAKE_SPAN
        return types.SimpleNamespace(type=rt.memoryTypeDevice if on_device else rt.memoryTypeUnregistered, device=0)


class FakeRecord(errors.ErrorRecord):
    """An error record in ordinary host memory (no pinned allocation, no GPU)."""

    def __init__(self, device_id: int = 0):
        self._memory = (ctypes.c_int32 * errors.RECORD_INTS)()
        self.host_ptr = self.device_ptr = ctypes.addressof(self._memory)
        self.device_id = device_id
        self.words = self._memory


@pytest.fixture
def fake_gpu(monkeypatch) -> FakeGPU:
    return FakeGPU(monkeypatch)


# --------------------------------------------------------------------------------------------
# CPU tests
# --------------------------------------------------------------------------------------------

def test_valid_arguments_pass_every_check(fake_gpu):
    # The table's rows differ from these arguments in one argument only: that is what they test.
    args = mla_args(fake_gpu.arrays)
    out, lse = args.pop("out"), args.pop("lse")
    inputs = checks.mla_inputs(**args)
    assert (inputs.batch, inputs.s_q, inputs.h_q, inputs.h_kv, inputs.num_sm_parts) == (B, S_Q, H_Q, H_KV, 132)
    assert checks.output_array(out, "out", (B, S_Q, H_Q, 512), BF16) is out
    assert checks.output_array(lse, "lse", (B, H_Q, S_Q), F32) is lse
    seqlens, heads_per_kv, h_kv, props = checks.metadata_inputs(**metadata_args(fake_gpu.arrays))
    assert (seqlens.shape, heads_per_kv, h_kv, props) == ((B,), Q_ROWS, H_KV, H100)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rejects(case, fake_gpu):
    args = call_args(case, fake_gpu.arrays)
    fake_gpu.props = case.props
    with pytest.raises(case.error) as e:
        case.fn(**args)
    check_message(case, e.value, fake_gpu.arrays.sm_count)
    assert fake_gpu.launches == []


@pytest.mark.parametrize("fn", [METADATA, MLA, attention.flash_attn_minimal],
                         ids=["get_mla_metadata", "flash_mla_with_kvcache", "flash_attn_minimal"])
@pytest.mark.parametrize("host_object", [HostDLPack(1), HostDLPack(3), HostCudaArrayInterface()],
                         ids=["dlpack-cpu", "dlpack-cuda-host", "cuda-array-interface"])
def test_host_memory_behind_gpu_array_protocols_is_refused(fn, host_object, fake_gpu):
    if fn is METADATA:
        args = dict(metadata_args(fake_gpu.arrays), cache_seqlens=host_object)
    elif fn is MLA:
        args = dict(mla_args(fake_gpu.arrays), q=host_object)
    else:
        args = dict(q=host_object, k=fake_array((1, 1, 4, 32)), v=fake_array((1, 1, 4, 32)))
    name = next(n for n, x in args.items() if x is host_object)
    with pytest.raises(TypeError, match=rf"^{name} must be a .*GPU array.*; got a fake_arrays\.Host"):
        fn(**args)


def test_non_hopper_gpu_is_refused_before_any_compile(fake_gpu, monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("NVRTC compile attempted on a non-Hopper GPU")

    monkeypatch.setattr(launch, "get_kernel", _REAL_GET_KERNEL)    # would compile and load
    monkeypatch.setattr(compiler, "build", no_compile)
    monkeypatch.setattr(compiler, "compile_program", no_compile)
    fake_gpu.props = A100
    with pytest.raises(flashmla_cupy.UnsupportedDeviceError, match="sm_80"):
        METADATA(**metadata_args(fake_gpu.arrays))
    with pytest.raises(flashmla_cupy.UnsupportedDeviceError, match="sm_80"):
        MLA(**mla_args(fake_gpu.arrays))


# --- value checks: modes, messages and the error record (errors.py) -------------------------------

@pytest.mark.parametrize("given, mode", [("async", "async"), ("SYNC", "sync"), (" off ", "off"), (True, "async"),
                                         (False, "off"), ("1", "async"), ("0", "off"), ("true", "async")])
def test_value_check_modes_parse(given, mode, monkeypatch):
    monkeypatch.setattr(errors, "_mode", "async")
    flashmla_cupy.set_value_checks(given)
    assert flashmla_cupy.value_check_mode() == mode
    with flashmla_cupy.value_checks("sync"):
        assert flashmla_cupy.value_check_mode() == "sync"
    assert flashmla_cupy.value_check_mode() == mode


@pytest.mark.parametrize("bad", ["yes", "", 2, None])
def test_value_check_mode_rejects_others(bad):
    with pytest.raises(ValueError, match=r"^value check mode must be one of async, sync, off"):
        flashmla_cupy.set_value_checks(bad)


@pytest.mark.parametrize("setting, mode", [("0", "off"), ("off", "off"), ("sync", "sync"), ("1", "async"),
                                           (None, "async")])
def test_environment_variable_sets_the_default(setting, mode):
    env = {k: v for k, v in os.environ.items() if k != "FLASHMLA_CUPY_VALUE_CHECKS"}
    if setting is not None:
        env["FLASHMLA_CUPY_VALUE_CHECKS"] = setting
    code = "import flashmla_cupy; print(flashmla_cupy.value_check_mode())"
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == mode


def test_environment_variable_with_a_bad_mode_says_so():
    env = dict(os.environ, FLASHMLA_CUPY_VALUE_CHECKS="maybe")
    result = subprocess.run([sys.executable, "-c", "import flashmla_cupy"], env=env, cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode != 0 and "FLASHMLA_CUPY_VALUE_CHECKS must be one of async, sync, off" in result.stderr


@pytest.mark.parametrize("code, fields, words", [
    (constants.ERROR_SEQLEN_NEGATIVE, (1, 0, -5, 0), "cache_seqlens[1] must be >= 0; got -5"),
    (constants.ERROR_SEQLEN_RANGE, (0, 64, 129, 2),
     "cache_seqlens[0] must be in [0, 128] (block_table holds 2 pages of 64 tokens per request); got 129"),
    (constants.ERROR_SEQLEN_RANGE, (0, 16, 33, 2),
     "cache_seqlens[0] must be in [0, 32] (block_table holds 2 pages of 16 tokens per request); got 33"),
    (constants.ERROR_BLOCK_ID, (1, 0, 4, 4),
     "block_table[1, 0] must be a block of k_cache (0 <= id < 4), since request 1 uses it; got 4"),
    (constants.ERROR_SCHEDULE, (3, 0, 77, 10), "tile_scheduler_metadata and num_splits must come from "
     "get_mla_metadata of this batch (request 3: split 77 outside [0, 10))"),
    (constants.ERROR_METADATA_KIND, (2, 0, -1, 2048), "tile_scheduler_metadata and num_splits must come from "
     "get_mla_metadata for this call: they were computed for dense decoding (no topk); this sparse call needs "
     "topk=2048 (indices' last dimension)"),
])
def test_error_record_reports_once_and_clears(code, fields, words, monkeypatch):
    monkeypatch.setattr(errors, "_mode", "async")
    record = FakeRecord()
    assert record.take() is None
    errors.raise_pending(record)                           # nothing recorded: no error
    record.words[0], record.words[1] = code, 1
    record.words[2], record.words[3], record.words[4], record.words[5] = fields
    with pytest.raises(ValueError) as e:
        errors.raise_pending(record)
    assert str(e.value).startswith(words) and "found on device 0" in str(e.value)
    metadata = code in (constants.ERROR_SCHEDULE, constants.ERROR_METADATA_KIND)
    spoiled = "out and lse are not valid" if metadata else "affected out/lse rows are NaN"
    assert spoiled in str(e.value)
    assert list(record.words) == [0, 0, *fields, 0, 0]     # code and claim cleared: the next error can land
    errors.raise_pending(record)


def test_error_record_in_off_mode_is_cleared_without_raising(monkeypatch):
    monkeypatch.setattr(errors, "_mode", "off")
    record = FakeRecord()
    record.words[0], record.words[1] = constants.ERROR_BLOCK_ID, 1
    errors.raise_pending(record)
    assert record.words[0] == 0 and errors.kernel_pointer(record) == 0
    monkeypatch.setattr(errors, "_mode", "async")
    assert errors.kernel_pointer(record) == record.device_ptr


def test_every_error_code_has_a_message():
    for name in dir(constants):
        if name.startswith("ERROR_"):
            assert not errors.describe(getattr(constants, name), 1, 2, 3, 4).startswith("unknown")


def test_error_codes_reach_the_kernels():
    # Each code is a -D define of every program (constants.defines), distinct and not 0 ("no error").
    codes = {name: getattr(constants, name) for name in dir(constants) if name.startswith("ERROR_")}
    defines = dict(constants.defines())
    assert codes and all(defines.get(f"FLASHMLA_{name}") == str(code) for name, code in codes.items())
    assert len(set(codes.values())) == len(codes) and 0 not in codes.values()
    assert errors.describe(99, 1, 2, 3, 4) == "unknown error code 99 (index 1, 2, value 3, bound 4)"


def test_value_checks_context_restores_the_mode(monkeypatch):
    monkeypatch.setattr(errors, "_mode", "async")
    with pytest.raises(RuntimeError):
        with flashmla_cupy.value_checks("off"):
            assert flashmla_cupy.value_check_mode() == "off"
            raise RuntimeError("inside")
    assert flashmla_cupy.value_check_mode() == "async"
    with pytest.raises(ValueError, match="value check mode must be one of"):
        with flashmla_cupy.value_checks("maybe"):
            pass
    assert flashmla_cupy.value_check_mode() == "async"


def _recorded(record, code, index0=0, index1=0, value=0, bound=0):
    """What a kernel's report_error leaves in the record."""
    record.words[0], record.words[1] = code, 1
    record.words[2], record.words[3], record.words[4], record.words[5] = index0, index1, value, bound
    return record


@pytest.mark.parametrize("mode, capturing, synchronizes", [("sync", False, True), ("sync", True, False),
                                                           ("async", False, False), ("off", False, False)])
def test_after_launch_synchronizes_only_in_sync_mode_outside_capture(mode, capturing, synchronizes, monkeypatch):
    monkeypatch.setattr(errors, "_mode", mode)
    monkeypatch.setattr(driver, "is_capturing", lambda stream_ptr: capturing)
    synchronized = []
    monkeypatch.setattr(cupy.cuda.runtime, "streamSynchronize", synchronized.append)
    record = _recorded(FakeRecord(), constants.ERROR_BLOCK_ID, 0, 2, -1, 4)
    if synchronizes:
        with pytest.raises(ValueError, match=r"^block_table\[0, 2\] must be a block of k_cache .*got -1"):
            errors.after_launch(record, 1234)
        assert synchronized == [1234] and record.words[0] == 0
    else:
        errors.after_launch(record, 1234)                  # raised later, by the next call
        assert synchronized == [] and record.words[0] == constants.ERROR_BLOCK_ID


def test_check_errors_synchronizes_every_device_then_raises(monkeypatch):
    records = {0: FakeRecord(0), 1: _recorded(FakeRecord(1), constants.ERROR_SEQLEN_NEGATIVE, 3, 0, -2)}
    events = []

    class Device:
        def __init__(self, device_id):
            self.device_id = device_id

        def __enter__(self):
            events.append(f"device {self.device_id}")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(errors, "_records", records)
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", lambda: events.append("synchronize"))
    with pytest.raises(ValueError, match=r"^cache_seqlens\[3\] must be >= 0; got -2 \(found on device 1 "):
        flashmla_cupy.check_errors()
    assert events == ["device 0", "synchronize", "device 1", "synchronize"]
    flashmla_cupy.check_errors()                           # reported once
    assert records[1].words[0] == 0


def test_calls_raise_a_pending_error_before_launching(fake_gpu, monkeypatch):
    # get_mla_metadata on the fake GPU (with out=: nothing is allocated): the kernel gets the
    # record's address ("async") or 0 ("off"); a recorded error is raised by the next call, before
    # it launches anything, and only once.
    record = FakeRecord()
    monkeypatch.setattr(errors, "record", lambda device_id: record)
    monkeypatch.setattr(errors, "_mode", "async")
    seqlens = fake_gpu.arrays.values(SEQLENS)
    out = fake_gpu.arrays.metadata(seqlens)
    assert METADATA(seqlens, Q_ROWS, H_KV, out=out) == out
    assert len(fake_gpu.launches) == 1 and fake_gpu.launches[-1].params.error == record.device_ptr != 0
    with flashmla_cupy.value_checks("off"):
        METADATA(seqlens, Q_ROWS, H_KV, out=out)
    assert len(fake_gpu.launches) == 2 and fake_gpu.launches[-1].params.error == 0
    _recorded(record, constants.ERROR_SEQLEN_NEGATIVE, 1, 0, -5)
    with pytest.raises(ValueError, match=r"^cache_seqlens\[1\] must be >= 0; got -5"):
        METADATA(seqlens, Q_ROWS, H_KV, out=out)
    assert len(fake_gpu.launches) == 2 and record.words[0] == 0
    METADATA(seqlens, Q_ROWS, H_KV, out=out)
    assert len(fake_gpu.launches) == 3


# --------------------------------------------------------------------------------------------
# GPU tests: real arrays; nothing the caller passed is written when a call raises
# --------------------------------------------------------------------------------------------

def _bits(args: dict) -> dict:
    return {name: cupy.asnumpy(x).tobytes() for name, x in args.items() if isinstance(x, cupy.ndarray)}


@pytest.mark.hopper
def test_gpu_valid_arguments_run():
    args = mla_args(DeviceArrays())
    out, lse = MLA(**args)
    assert out is args["out"] and lse is args["lse"]
    flashmla_cupy.check_errors()


@pytest.mark.hopper
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id for c in GPU_CASES])
def test_gpu_rejects_and_writes_nothing(case):
    arrays = DeviceArrays()
    args = call_args(case, arrays)
    before = _bits(args)
    with pytest.raises(case.error) as e:
        case.fn(**args)
    check_message(case, e.value, arrays.sm_count)
    cupy.cuda.Device().synchronize()
    assert _bits(args) == before


# --------------------------------------------------------------------------------------------
# Sparse decoding (indices over DeepSeek-V3.2's FP8 cache): bad arguments, before any launch
# --------------------------------------------------------------------------------------------

SPARSE_S_Q, SPARSE_TOPK = 2, 128


def sparse_args(arrays, **change) -> dict:
    """A valid sparse call on fake arrays; ``change`` replaces arguments (callables get the
    arrays)."""
    parts = scheduler.num_sm_parts(arrays.sm_count, H_Q, 1)
    args = dict(q=arrays.empty((B, SPARSE_S_Q, H_Q, 576), BF16),
                k_cache=arrays.empty((NUM_BLOCKS, 64, 1, 656), np.uint8),
                block_table=None, cache_seqlens=None, head_dim_v=512,
                tile_scheduler_metadata=arrays.empty((parts, scheduler.SCHED_META_INTS), I32),
                num_splits=arrays.empty((B * SPARSE_S_Q + 1,), I32), is_fp8_kvcache=True,
                indices=arrays.empty((B, SPARSE_S_Q, SPARSE_TOPK), I32),
                attn_sink=arrays.empty((H_Q,), F32), topk_length=arrays.empty((B,), I32))
    args.update({k: v(arrays) if callable(v) else v for k, v in change.items()})
    return args


SPARSE_CASES = [  # (id, change, error, message)
    ("cache-width", dict(k_cache=lambda a: a.empty((NUM_BLOCKS, 64, 1, 576), np.uint8)), ValueError,
     r"k_cache must be \[num_blocks, page_block_size, 1, 656\] \(one KV head, 656 bytes per token\)"),
    ("cache-dtype", dict(k_cache=lambda a: a.empty((NUM_BLOCKS, 64, 1, 656), F16)), TypeError,
     r"k_cache must hold the FP8 cache's bytes \(uint8, int8 or float8_e4m3fn\); got float16"),
    ("cache-h_kv", dict(k_cache=lambda a: a.empty((NUM_BLOCKS, 64, 2, 656), np.uint8)), ValueError,
     r"k_cache must be \[num_blocks, page_block_size, 1, 656\]"),
    ("q-dtype", dict(q=lambda a: a.empty((B, SPARSE_S_Q, H_Q, 576), F16)), TypeError, r"^q must have dtype bfloat16; got float16"),
    ("indices-shape", dict(indices=lambda a: a.empty((B, 1, SPARSE_TOPK), I32)), ValueError,
     rf"indices must have shape \({B}, {SPARSE_S_Q}, topk\)"),
    ("indices-dtype", dict(indices=lambda a: a.empty((B, SPARSE_S_Q, SPARSE_TOPK), I64)), TypeError,
     r"^indices must have dtype int32; got int64"),
    ("causal", dict(causal=True), ValueError, r"causal must be False with indices"),
    ("not-fp8", dict(is_fp8_kvcache=False), ValueError, r"indices \(sparse decoding\) needs the FP8 cache"),
    ("topk_length-shape", dict(topk_length=lambda a: a.empty((B + 1,), I32)), ValueError,
     rf"topk_length must have shape \({B},\)"),
    ("attn_sink-dtype", dict(attn_sink=lambda a: a.empty((H_Q,), F16)), TypeError, r"^attn_sink must have dtype float32; got float16"),
    ("num_splits-per-request", dict(num_splits=lambda a: a.empty((B + 1,), I32)), ValueError,
     rf"num_splits must be int32 \({B * SPARSE_S_Q + 1},\)"),
]


@pytest.mark.parametrize("change,error,message", [c[1:] for c in SPARSE_CASES], ids=[c[0] for c in SPARSE_CASES])
def test_sparse_call_rejects(change, error, message, fake_gpu):
    with pytest.raises(error, match=message):
        mla.flash_mla_with_kvcache(**sparse_args(fake_gpu.arrays, **change))
    assert fake_gpu.launches == []


def test_sparse_valid_arguments_pass_every_check(fake_gpu):
    # SPARSE_CASES differ from these arguments in one argument only.
    from flashmla_cupy import sparse

    args = sparse_args(fake_gpu.arrays)
    inputs = sparse.sparse_inputs(args["q"], args["k_cache"], 512, args["tile_scheduler_metadata"],
                                  args["num_splits"], None, False, True, args["indices"], args["attn_sink"],
                                  args["topk_length"])
    assert (inputs.batch, inputs.s_q, inputs.h_q, inputs.topk, inputs.requests) == (B, SPARSE_S_Q, H_Q, SPARSE_TOPK,
                                                                                     B * SPARSE_S_Q)


def test_sparse_call_checks_a_layout_once_then_writes_pointers(fake_gpu, monkeypatch):
    # The sparse call takes the dense call's fast path: the first call of a layout runs every
    # check, later ones only write their arrays' addresses into the prebuilt launches; a call
    # with another layout (an optional array left out, a wrong dtype) is checked again.
    from flashmla_cupy import sparse, tma

    monkeypatch.setattr(tma, "rows_4d_at", lambda *args, **kwargs: bytes(128))       # no driver here
    checked = []
    real_inputs = sparse.sparse_inputs
    monkeypatch.setattr(sparse, "sparse_inputs", lambda *args: checked.append(1) or real_inputs(*args))
    a = fake_gpu.arrays
    args = sparse_args(a)
    parts = args["tile_scheduler_metadata"].shape[0]
    ws = mla.MLAWorkspace(B * SPARSE_S_Q, 1, H_Q, 1, parts, BF16, alloc=lambda n: a.empty((n,), np.uint8))
    for call in range(3):
        out, lse = a.empty((B, SPARSE_S_Q, H_Q, 512), BF16), a.empty((B, H_Q, SPARSE_S_Q), F32)
        if call == 2:
            args["topk_length"] = None
        assert mla.flash_mla_with_kvcache(**args, out=out, lse=lse, workspace=ws) == (out, lse)
        assert len(checked) == (1 if call < 2 else 2)
        splitkv, combine = fake_gpu.launches[-2:]
        p, c = splitkv.params, combine.params
        assert (p.block_table, p.seqlens) == (0, 0)
        assert (p.sched_meta, p.num_splits, p.indices, p.cache, p.attn_sink) == tuple(
            args[k].data.ptr for k in ("tile_scheduler_metadata", "num_splits", "indices", "k_cache", "attn_sink"))
        assert p.topk_length == (args["topk_length"].data.ptr if call < 2 else 0)
        assert (p.o, p.lse, p.lse_accum, p.o_accum) == (out.data.ptr, lse.data.ptr, ws.lse_accum_ptr, ws.o_accum_ptr)
        assert (c.o, c.lse, c.num_splits, c.attn_sink) == (p.o, p.lse, p.num_splits, p.attn_sink)
        assert p.topk == SPARSE_TOPK and p.batch == c.batch == B * SPARSE_S_Q
    with pytest.raises(TypeError, match=r"^q must have dtype bfloat16; got float16"):
        mla.flash_mla_with_kvcache(**dict(args, q=a.empty((B, SPARSE_S_Q, H_Q, 576), F16)), out=out, lse=lse,
                                   workspace=ws)
    assert len(fake_gpu.launches) == 6


@pytest.mark.parametrize("h_q", [128, 64, 16])
def test_sparse_call_pairs_ctas_where_two_m_blocks_share_the_pages(fake_gpu, monkeypatch, h_q):
    # h_q 128: two m-blocks, launched as 2-CTA clusters in the kernel's form for pairs; fewer
    # heads: one m-block, the form for a CTA alone (a program of its own), no cluster.
    from flashmla_cupy import tma

    monkeypatch.setattr(tma, "rows_4d_at", lambda *args, **kwargs: bytes(128))       # no driver here
    a = fake_gpu.arrays
    parts = scheduler.num_sm_parts(a.sm_count, h_q, 1)
    args = sparse_args(a, q=lambda a: a.empty((B, SPARSE_S_Q, h_q, 576), BF16),
                       attn_sink=lambda a: a.empty((h_q,), F32),
                       tile_scheduler_metadata=lambda a: a.empty((parts, scheduler.SCHED_META_INTS), I32))
    out, lse = a.empty((B, SPARSE_S_Q, h_q, 512), BF16), a.empty((B, h_q, SPARSE_S_Q), F32)
    ws = mla.MLAWorkspace(B * SPARSE_S_Q, 1, h_q, 1, parts, BF16, alloc=lambda n: a.empty((n,), np.uint8))
    mla.flash_mla_with_kvcache(**args, out=out, lse=lse, workspace=ws)
    splitkv = fake_gpu.launches[-2]
    pairs = h_q == 128
    assert splitkv.program == programs.splitkv_program(programs.SPARSE_FP8_TAG, alone=not pairs)
    assert (splitkv.grid[0], splitkv.options["cluster_x"]) == ((2, 2) if pairs else (1, 1))


@pytest.mark.parametrize("page", [64, 1])
def test_dense_call_gives_the_kernel_the_caches_bytes(fake_gpu, monkeypatch, page):
    # The 16-bit kernel reads the cache by TMA, and at one-token pages (a program of its own) by
    # cp.async from its bytes: their address and strides are in its parameters; the FP8 and
    # sparse fields stay 0.
    from flashmla_cupy import tma

    monkeypatch.setattr(tma, "rows_4d_at", lambda *args, **kwargs: bytes(128))       # no driver here
    a = fake_gpu.arrays
    args = mla_args(a)
    args["k_cache"] = a.empty((NUM_BLOCKS * 64 // page, page, H_KV, 576), BF16)
    ws = mla.MLAWorkspace(B, S_Q, H_Q, H_KV, args["tile_scheduler_metadata"].shape[0], BF16,
                          alloc=lambda n: a.empty((n,), np.uint8))
    assert MLA(**args, workspace=ws) == (args["out"], args["lse"])
    splitkv, k = fake_gpu.launches[-2], args["k_cache"]
    assert splitkv.program == programs.splitkv_program("bf16", one_token_pages=page == 1)
    p = splitkv.params
    assert (p.cache, p.cache_block_stride, p.cache_head_stride) == (k.data.ptr, k.strides[0], k.strides[2])
    assert (p.page_block_size, p.piece_shift) == (page, min(page, 64).bit_length() - 1)
    assert (p.kv_scale, p.q_scale, p.indices, p.topk_length, p.attn_sink) == (0, 0, 0, 0, 0)


def test_tensor_maps_are_encoded_again_only_for_a_new_address(fake_gpu, monkeypatch):
    # The plan keeps each map's last address: a call with the same q and cache encodes nothing, a
    # new cache array its map alone, written into the prebuilt launch's parameters.
    from flashmla_cupy import tma

    encoded = []
    monkeypatch.setattr(tma, "rows_4d_at", lambda address, *args, **kwargs: encoded.append(address) or
                        address.to_bytes(8, "little") * 16)
    a = fake_gpu.arrays
    args = mla_args(a)
    ws = mla.MLAWorkspace(B, S_Q, H_Q, H_KV, args["tile_scheduler_metadata"].shape[0], BF16,
                          alloc=lambda n: a.empty((n,), np.uint8))
    q_address = None
    for call, new_cache in enumerate((False, False, True)):
        if new_cache:                                     # fake arrays all start at one address
            args["k_cache"] = a.empty(args["k_cache"].shape, BF16, offset=512)
        encoded.clear()
        MLA(**args, workspace=ws)
        k_address = args["k_cache"].data.ptr
        if call == 0:
            assert len(encoded) == 2 and encoded[1] == k_address      # Q (in place or in the workspace), cache
            q_address = encoded[0]
        else:
            assert encoded == ([k_address] if new_cache else []), call
        p = fake_gpu.launches[-2].params
        assert bytes(p.tma_kv)[:8] == k_address.to_bytes(8, "little")
        assert bytes(p.tma_q)[:8] == q_address.to_bytes(8, "little")


# --------------------------------------------------------------------------------------------
# The dense FP8 cache (is_fp8_kvcache=True with k_scale, no indices): bad arguments, before any launch
# --------------------------------------------------------------------------------------------

def fp8_args(arrays, **change) -> dict:
    """A valid dense FP8 call (one KV head) on fake arrays; ``change`` as in ``sparse_args``."""
    seqlens = arrays.values(SEQLENS)
    parts = scheduler.num_sm_parts(arrays.sm_count, S_Q * H_Q, 1)
    args = dict(q=arrays.empty((B, S_Q, H_Q, 576), BF16), k_cache=arrays.empty((NUM_BLOCKS, 64, 1, 576), np.uint8),
                block_table=arrays.values(BLOCK_TABLE), cache_seqlens=seqlens, head_dim_v=512,
                tile_scheduler_metadata=arrays.empty((parts, scheduler.SCHED_META_INTS), I32),
                num_splits=arrays.empty((B + 1,), I32), causal=True, is_fp8_kvcache=True,
                k_scale=arrays.empty((), F32))
    args.update({k: v(arrays) if callable(v) else v for k, v in change.items()})
    return args


FP8_CASES = [  # (id, change, error, message)
    ("no-k_scale", dict(k_scale=None), ValueError, r"^k_scale is required with the FP8 cache \(is_fp8_kvcache=True\)"),
    ("k_scale-without-fp8", dict(is_fp8_kvcache=False), ValueError,
     r"^k_scale is for the dense FP8 cache: pass is_fp8_kvcache=True \(and k_scale\)"),
    ("q_scale-without-fp8", dict(is_fp8_kvcache=False, k_scale=None, q_scale=lambda a: a.empty((), F32)), ValueError,
     r"^q_scale is for the dense FP8 cache: pass is_fp8_kvcache=True \(and k_scale\)"),
    ("k_scale-dtype", dict(k_scale=lambda a: a.empty((1,), F16)), TypeError, r"^k_scale must have dtype float32; got float16"),
    ("k_scale-shape", dict(k_scale=lambda a: a.empty((2,), F32)), ValueError,
     r"^k_scale must hold one float32 \(shape \(\) or \(1,\)\); got shape \(2,\)"),
    ("k_scale-host", dict(k_scale=np.ones((), F32)), TypeError, r"^k_scale must be a GPU array"),
    ("q_scale-with-bf16-q", dict(q_scale=lambda a: a.empty((), F32)), TypeError,
     r"^q must hold e4m3 values \(uint8, int8 or float8_e4m3fn\) with q_scale; got bfloat16"),
    ("e4m3-q-without-q_scale", dict(q=lambda a: a.empty((B, S_Q, H_Q, 576), np.uint8)), ValueError,
     r"^q holds e4m3 values \(uint8\): pass its dequantization scale as q_scale"),
    ("q_scale-dtype", dict(q=lambda a: a.empty((B, S_Q, H_Q, 576), np.uint8), q_scale=lambda a: a.empty((), F16)),
     TypeError, r"^q_scale must have dtype float32; got float16"),
    ("q_scale-shape", dict(q=lambda a: a.empty((B, S_Q, H_Q, 576), np.uint8), q_scale=lambda a: a.empty((1, 1), F32)),
     ValueError, r"^q_scale must hold one float32 \(shape \(\) or \(1,\)\); got shape \(1, 1\)"),
    ("q_scale-host", dict(q=lambda a: a.empty((B, S_Q, H_Q, 576), np.uint8), q_scale=np.ones((), F32)), TypeError,
     r"^q_scale must be a GPU array"),
    ("e4m3-q-misaligned", dict(q=lambda a: a.empty((B, S_Q, H_Q, 576), np.uint8, offset=8),
                               q_scale=lambda a: a.empty((), F32)), ValueError, r"^q must start on a 16-byte boundary"),
    ("is_fp8_kvcache-str", dict(is_fp8_kvcache="yes"), TypeError, r"^is_fp8_kvcache must be a bool"),
    ("q-fp16", dict(q=lambda a: a.empty((B, S_Q, H_Q, 576), F16)), TypeError,
     r"^q \(with the FP8 cache; or e4m3 values with q_scale\) must have dtype bfloat16; got float16"),
    ("cache-bf16", dict(k_cache=lambda a: a.empty((NUM_BLOCKS, 64, 1, 576), BF16)), TypeError,
     r"^k_cache must hold the FP8 cache's e4m3 values \(uint8, int8 or float8_e4m3fn\); got bfloat16"),
    ("cache-h_kv-2", dict(k_cache=lambda a: a.empty((NUM_BLOCKS, 64, 2, 576), np.uint8)), ValueError,
     r"^k_cache \(FP8\) must have one head \(axis 2; MLA's latent cache\)"),
    ("cache-656", dict(k_cache=lambda a: a.empty((NUM_BLOCKS, 64, 1, 656), np.uint8)), ValueError,
     r"^k_cache must have head dim \(axis 3\) 576"),
    ("cache-page-48", dict(k_cache=lambda a: a.empty((NUM_BLOCKS, 48, 1, 576), np.uint8)), ValueError,
     r"^k_cache must have a power-of-two page block size"),
    ("cache-token-stride", dict(k_cache=lambda a: a.empty((NUM_BLOCKS, 64, 1, 576), np.uint8, step=2)), ValueError,
     r"^k_cache must be contiguous in its last dimension"),
    ("cache-misaligned", dict(k_cache=lambda a: a.empty((NUM_BLOCKS, 64, 1, 576), np.uint8, offset=8)), ValueError,
     r"^k_cache must start on a 16-byte boundary"),
    ("sink", dict(attn_sink=lambda a: a.empty((H_Q,), F32)), ValueError, r"^attn_sink and topk_length are for sparse"),
    ("indices-with-k_scale", dict(indices=lambda a: a.empty((B, S_Q, 64), I32)), ValueError,
     r"^k_scale is for dense decoding over the FP8 cache; sparse decoding takes a bf16 q"),
    ("indices-with-q_scale", dict(indices=lambda a: a.empty((B, S_Q, 64), I32), k_scale=None,
                                  q_scale=lambda a: a.empty((), F32)), ValueError,
     r"^q_scale is for dense decoding over the FP8 cache; sparse decoding takes a bf16 q"),
]


@pytest.mark.parametrize("change,error,message", [c[1:] for c in FP8_CASES], ids=[c[0] for c in FP8_CASES])
def test_fp8_call_rejects(change, error, message, fake_gpu):
    with pytest.raises(error, match=message):
        mla.flash_mla_with_kvcache(**fp8_args(fake_gpu.arrays, **change))
    assert fake_gpu.launches == []


@pytest.mark.parametrize("h_q", [16, 32, 64, 128])
@pytest.mark.parametrize("e4m3_q", [False, True])
@pytest.mark.parametrize("page", [1, 16, 64, 256])
def test_fp8_call_launches_the_fp8_kernel_with_its_pointers(page, e4m3_q, h_q, fake_gpu, monkeypatch):
    # FP8_CASES differ from these arguments in one argument only. The cache's bytes are staged
    # by TMA (a byte map, boxes of one piece's rows of 128 bytes); k_scale's address goes to the
    # kernel. An e4m3 q: the kernel of its own (FP8 WGMMA), its bytes staged by a byte map too
    # (boxes of 64 rows of 128 bytes), q_scale's address in the kernel's parameters (else 0), out bf16.
    # A bf16 q of at most 32 rows: the narrow kernel (the cache dequantized in registers), its mma.sync
    # form (160 threads) for at most 16 rows, its WGMMA form (384) for more.
    from flashmla_cupy import tma

    maps = []
    monkeypatch.setattr(tma, "rows_4d_at", lambda *args, **kwargs: maps.append((args, kwargs)) or bytes(128))
    a = fake_gpu.arrays
    parts = scheduler.num_sm_parts(a.sm_count, S_Q * h_q, 1)
    change = dict(q=lambda a: a.empty((B, S_Q, h_q, 576), np.uint8 if e4m3_q else BF16),
                  tile_scheduler_metadata=lambda a: a.empty((parts, scheduler.SCHED_META_INTS), I32))
    if e4m3_q:
        change["q_scale"] = lambda a: a.empty((1,), F32)
    args = fp8_args(a, k_cache=lambda a: a.empty((NUM_BLOCKS, page, 1, 576), np.uint8), **change)
    out, lse = a.empty((B, S_Q, h_q, 512), BF16), a.empty((B, h_q, S_Q), F32)
    ws = mla.MLAWorkspace(B, S_Q, h_q, 1, parts, BF16, alloc=lambda n: a.empty((n,), np.uint8))
    assert mla.flash_mla_with_kvcache(**args, out=out, lse=lse, workspace=ws) == (out, lse)
    splitkv, combine = fake_gpu.launches[-2:]
    p = splitkv.params
    assert (p.cache, p.kv_scale, p.block_table, p.seqlens) == tuple(
        args[k].data.ptr for k in ("k_cache", "k_scale", "block_table", "cache_seqlens"))
    assert (p.indices, p.topk_length, p.attn_sink) == (0, 0, 0)
    assert p.q_scale == (args["q_scale"].data.ptr if e4m3_q else 0)
    assert (p.page_block_size, p.page_shift, p.cache_block_stride) == (page, page.bit_length() - 1, page * 576)
    assert "cluster_x" not in splitkv.options
    if not e4m3_q and S_Q * h_q <= 32:
        assert splitkv.program == programs.fp8_narrow_program()
        form = f"<{16 if S_Q * h_q <= 16 else 32}, {'true' if page == 1 else 'false'}>"   # one-token pages: copies
        assert splitkv.kernel == f"flashmla::fp8_narrow_mla_kernel{form}" in programs.fp8_narrow_program().kernels
        assert splitkv.block[0] == 384 and splitkv.grid == (1, 1, parts)
        assert splitkv.options["smem"] == programs.FP8_NARROW_SMEM_BYTES
    else:
        # one-token pages: a form of their own (tokens copied with cp.async)
        assert splitkv.program == programs.splitkv_program(programs.FP8_Q_TAG if e4m3_q else programs.FP8_TAG,
                                                           one_token_pages=page == 1)
        assert splitkv.block[0] == 384 and splitkv.grid == (-(-S_Q * h_q // 64), 1, parts)
    (q_address, q_dtype, q_shape, q_strides), q_kwargs = maps[-2]
    assert (q_address, q_shape) == (args["q"].data.ptr, (B, S_Q * h_q, 1, 576))
    if e4m3_q:
        assert np.dtype(q_dtype) == np.uint8 and q_strides == (S_Q * h_q * 576, 576, S_Q * h_q * 576, 1)
        assert q_kwargs == {"box_rows": 64, "box_cols": 128, "l2_promotion": 128}
    else:
        assert np.dtype(q_dtype) == BF16 and q_kwargs == {"box_rows": 64, "box_cols": 64, "l2_promotion": 128}
    (address, dtype, shape, strides), kwargs = maps[-1]
    assert (address, np.dtype(dtype), shape) == (args["k_cache"].data.ptr, np.uint8, (NUM_BLOCKS, page, 1, 576))
    # 256-byte L2 promotion where several m-blocks' CTAs read each page
    assert kwargs == {"box_rows": min(page, 64), "box_cols": 128, "l2_promotion": 256 if S_Q * h_q > 64 else 128}
    assert (p.o, p.lse, combine.params.o) == (out.data.ptr, lse.data.ptr, out.data.ptr)


@pytest.mark.parametrize("sparse_call", [False, True])
@pytest.mark.parametrize("name", ["q", "k_cache", "tile_scheduler_metadata"])
def test_a_missing_array_is_named(name, sparse_call, fake_gpu):
    # None where an array is required: the first call of a layout names it (any position).
    args = sparse_args(fake_gpu.arrays) if sparse_call else mla_args(fake_gpu.arrays)
    with pytest.raises(TypeError, match=rf"^{name} must be a GPU array"):
        mla.flash_mla_with_kvcache(**dict(args, **{name: None}))
    assert fake_gpu.launches == []
