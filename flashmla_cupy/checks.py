"""Argument validation shared by the public functions: it only checks and prepares.

Every check runs before anything is launched and never writes to the caller's arrays. Errors
are ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape, layout or
value), and name the argument, what was expected and what was given. Devices other than Hopper
raise ``UnsupportedDeviceError`` before any compilation.

Value checks (sequence lengths against the block table, block ids against the cache) need the
values on the host: one small device-to-host copy, which synchronizes the stream. They are on by
default and skipped during CUDA-graph capture; ``set_value_checks(False)`` (or the environment
variable ``FLASHMLA_CUPY_VALUE_CHECKS=0``) turns them off for production decode loops, where an
out-of-range block id reads zeros (TMA bounds) and a sequence longer than its block-table row is
undefined behavior.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import cupy
import numpy as np

from . import scheduler

HEAD_DIM_K = 576
HEAD_DIM_V = 512
PAGE_BLOCK_SIZE = scheduler.PAGE_BLOCK_SIZE


class UnsupportedDeviceError(RuntimeError):
    """The current GPU cannot run these kernels (they need Hopper, sm_90)."""


_value_checks = os.environ.get("FLASHMLA_CUPY_VALUE_CHECKS", "1") not in ("0", "false", "off")


def set_value_checks(enabled: bool) -> None:
    """Turn the host-side value checks of ``flash_mla_with_kvcache`` on or off (module-wide)."""
    global _value_checks
    _value_checks = bool(enabled)


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Context manager form of ``set_value_checks``."""
    global _value_checks
    previous, _value_checks = _value_checks, bool(enabled)
    try:
        yield
    finally:
        _value_checks = previous


def value_checks_enabled() -> bool:
    return _value_checks and not cupy.cuda.get_current_stream().is_capturing()


# --------------------------------------------------------------------------------------------
# Arrays
# --------------------------------------------------------------------------------------------

def _dtype_name(dtype) -> str:
    return "bfloat16" if np.dtype(dtype).name in ("bfloat16",) else np.dtype(dtype).name


def as_device_array(x, name: str) -> cupy.ndarray:
    """A CuPy view of ``x`` on the current device, zero-copy for foreign GPU arrays.

    Accepts CuPy arrays and objects exposing ``__dlpack__`` (PyTorch, JAX, ...) or
    ``__cuda_array_interface__``; rejects host arrays and arrays on another device.
    """
    if isinstance(x, cupy.ndarray):
        arr = x
    elif isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a GPU array (CuPy, or any __dlpack__/__cuda_array_interface__ "
                        f"object); got a NumPy array in host memory (use cupy.asarray({name}))")
    elif hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type, _ = x.__dlpack_device__()
        if int(device_type) not in (2, 3, 13):  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
            raise TypeError(f"{name} must be a GPU array; got a {type(x).__module__}.{type(x).__name__} "
                            f"in host memory (DLPack device type {int(device_type)})")
        arr = cupy.from_dlpack(x)
    elif hasattr(x, "__cuda_array_interface__"):
        arr = cupy.asarray(x)
    else:
        raise TypeError(f"{name} must be a GPU array (CuPy, or any __dlpack__/__cuda_array_interface__ "
                        f"object); got {type(x).__module__}.{type(x).__name__}")
    current = cupy.cuda.runtime.getDevice()
    if arr.device.id != current:
        raise ValueError(f"{name} is on device {arr.device.id} but CuPy's current device is {current}; "
                         f"call under `with cupy.cuda.Device({arr.device.id}):` or move the array")
    return arr


def require_dtype(arr, name: str, allowed, what: str | None = None) -> None:
    allowed = tuple(np.dtype(a) for a in allowed)
    if arr.dtype not in allowed:
        expected = what or " or ".join(_dtype_name(a) for a in allowed)
        raise TypeError(f"{name} must have dtype {expected}; got {_dtype_name(arr.dtype)}")


def require_ndim(arr, name: str, ndim: int, layout: str) -> None:
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}; got shape {tuple(arr.shape)}")


def require_last_dim_contiguous(arr, name: str) -> None:
    if arr.shape[-1] > 1 and arr.strides[-1] != arr.itemsize:
        raise ValueError(f"{name} must be contiguous in its last dimension; got strides {arr.strides} "
                         f"(bytes) for shape {tuple(arr.shape)}")


def require_contiguous(arr, name: str) -> None:
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous; got strides {arr.strides} for shape {tuple(arr.shape)}")


def require_hopper(device_id: int) -> dict:
    from .launch import device_properties

    props = device_properties(device_id)
    if props["major"] != 9:
        raise UnsupportedDeviceError(
            f"flashmla-cupy's MLA kernels need a Hopper GPU (sm_90: H100, H200, H800, H20); "
            f"device {device_id} is {props['name']} (sm_{props['major']}{props['minor']})")
    return props


def bfloat16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def _int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return int(value)


# --------------------------------------------------------------------------------------------
# get_mla_metadata
# --------------------------------------------------------------------------------------------

def metadata_inputs(cache_seqlens, num_heads_per_head_k, num_heads_k) -> tuple[cupy.ndarray, int, int, dict]:
    """Checked arguments of get_mla_metadata, and the (Hopper) device's properties."""
    seqlens = as_device_array(cache_seqlens, "cache_seqlens")
    require_ndim(seqlens, "cache_seqlens", 1, "[batch]")
    require_dtype(seqlens, "cache_seqlens", [np.int32])
    if seqlens.shape[0] == 0:
        raise ValueError("cache_seqlens must hold at least one request (batch >= 1); got shape (0,)")
    require_contiguous(seqlens, "cache_seqlens")
    heads_per_kv = _int(num_heads_per_head_k, "num_heads_per_head_k", 1)
    h_kv = _int(num_heads_k, "num_heads_k", 1)
    props = require_hopper(cupy.cuda.runtime.getDevice())
    if value_checks_enabled():
        host = cupy.asnumpy(seqlens)
        if (host < 0).any():
            i = int(np.flatnonzero(host < 0)[0])
            raise ValueError(f"cache_seqlens[{i}] = {int(host[i])} is negative")
    return seqlens, heads_per_kv, h_kv, props


# --------------------------------------------------------------------------------------------
# flash_mla_with_kvcache
# --------------------------------------------------------------------------------------------

@dataclass
class MLAInputs:
    q: cupy.ndarray
    k_cache: cupy.ndarray
    block_table: cupy.ndarray
    cache_seqlens: cupy.ndarray
    tile_scheduler_metadata: cupy.ndarray
    num_splits: cupy.ndarray
    batch: int
    s_q: int
    h_q: int
    h_kv: int
    softmax_scale: float
    causal: bool
    num_sm_parts: int

    @property
    def heads_per_kv(self) -> int:
        return self.h_q // self.h_kv

    @property
    def q_rows(self) -> int:
        return self.s_q * self.heads_per_kv


def mla_inputs(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
               num_splits, softmax_scale, causal) -> MLAInputs:
    """Checked arguments of flash_mla_with_kvcache (the device must be a Hopper GPU)."""
    q = as_device_array(q, "q")
    k_cache = as_device_array(k_cache, "k_cache")
    block_table = as_device_array(block_table, "block_table")
    cache_seqlens = as_device_array(cache_seqlens, "cache_seqlens")
    tile_scheduler_metadata = as_device_array(tile_scheduler_metadata, "tile_scheduler_metadata")
    num_splits = as_device_array(num_splits, "num_splits")

    require_dtype(q, "q", [bfloat16(), np.float16])
    if k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache must have q's dtype ({_dtype_name(q.dtype)}); got {_dtype_name(k_cache.dtype)}")
    for arr, name in ((block_table, "block_table"), (cache_seqlens, "cache_seqlens"),
                      (tile_scheduler_metadata, "tile_scheduler_metadata"), (num_splits, "num_splits")):
        require_dtype(arr, name, [np.int32])

    require_ndim(q, "q", 4, "[batch, s_q, h_q, 576]")
    require_ndim(k_cache, "k_cache", 4, "[num_blocks, 64, h_kv, 576]")
    require_ndim(block_table, "block_table", 2, "[batch, max_blocks_per_seq]")
    require_ndim(cache_seqlens, "cache_seqlens", 1, "[batch]")
    require_ndim(tile_scheduler_metadata, "tile_scheduler_metadata", 2, "[num_sm_parts, 8]")
    require_ndim(num_splits, "num_splits", 1, "[batch + 1]")

    batch, s_q, h_q, d = q.shape
    num_blocks, page, h_kv, d_k = k_cache.shape
    if d != HEAD_DIM_K:
        raise ValueError(f"q's head dim (last axis) must be {HEAD_DIM_K}; got {d} (shape {tuple(q.shape)})")
    if d_k != HEAD_DIM_K:
        raise ValueError(f"k_cache's head dim (last axis) must be {HEAD_DIM_K}; got {d_k} (shape {tuple(k_cache.shape)})")
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, (int, np.integer)) or head_dim_v != HEAD_DIM_V:
        raise ValueError(f"head_dim_v must be {HEAD_DIM_V}; got {head_dim_v!r}")
    if page != PAGE_BLOCK_SIZE:
        raise ValueError(f"k_cache's page block size (axis 1) must be {PAGE_BLOCK_SIZE}; got {page}")
    if batch == 0:
        raise ValueError(f"q must hold at least one request (batch >= 1); got shape {tuple(q.shape)}")
    if s_q == 0:
        raise ValueError(f"q must hold at least one query token (s_q >= 1); got shape {tuple(q.shape)}")
    if h_q == 0 or h_kv == 0 or h_q % h_kv:
        raise ValueError(f"q's heads ({h_q}) must be a positive multiple of k_cache's heads ({h_kv})")
    if num_blocks == 0:
        raise ValueError(f"k_cache must hold at least one block; got shape {tuple(k_cache.shape)}")
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table must have one row per request ({batch}); got shape {tuple(block_table.shape)}")
    if block_table.shape[1] == 0:
        raise ValueError(f"block_table must have at least one column; got shape {tuple(block_table.shape)}")
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens must have one entry per request ({batch}); got shape {tuple(cache_seqlens.shape)}")
    q_rows = s_q * (h_q // h_kv)
    device_props = require_hopper(cupy.cuda.runtime.getDevice())
    parts = scheduler.num_sm_parts(device_props["sm_count"], q_rows, h_kv)
    if tile_scheduler_metadata.shape != (parts, scheduler.SCHED_META_INTS):
        raise ValueError(
            f"tile_scheduler_metadata must have shape ({parts}, {scheduler.SCHED_META_INTS}) for this batch's "
            f"head layout (get_mla_metadata(cache_seqlens, s_q*h_q//h_kv={q_rows}, h_kv={h_kv})); "
            f"got {tuple(tile_scheduler_metadata.shape)}")
    if num_splits.shape != (batch + 1,):
        raise ValueError(f"num_splits must have shape ({batch + 1},) (batch + 1, from get_mla_metadata of "
                         f"this batch); got {tuple(num_splits.shape)}")

    require_last_dim_contiguous(q, "q")
    require_last_dim_contiguous(k_cache, "k_cache")
    require_last_dim_contiguous(block_table, "block_table")
    for arr, name in ((cache_seqlens, "cache_seqlens"), (tile_scheduler_metadata, "tile_scheduler_metadata"),
                      (num_splits, "num_splits")):
        require_contiguous(arr, name)
    # TMA: 16-byte aligned base and strides.
    if k_cache.data.ptr % 16 or any(s % 16 for s in k_cache.strides[:3]):
        raise ValueError(f"k_cache must start on a 16-byte boundary with 16-byte-multiple strides (TMA); "
                         f"got address {k_cache.data.ptr:#x}, strides {k_cache.strides}")

    if softmax_scale is None:
        softmax_scale = HEAD_DIM_K ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite float or None; got {softmax_scale!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")

    inputs = MLAInputs(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                       batch, s_q, h_q, h_kv, float(softmax_scale), bool(causal) and s_q > 1, parts)
    if value_checks_enabled():
        check_values(inputs)
    return inputs


def output_array(x, name: str, shape: tuple, dtype) -> cupy.ndarray:
    """A caller-provided output: a C-contiguous CuPy array of exactly this shape and dtype."""
    arr = as_device_array(x, name)
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(arr.shape)}")
    if arr.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {_dtype_name(dtype)}; got {_dtype_name(arr.dtype)}")
    require_contiguous(arr, name)
    return arr


def check_values(inputs: MLAInputs) -> None:
    """Sequence lengths within [0, 64 * max_blocks]; the block ids they use within the cache."""
    seqlens = cupy.asnumpy(inputs.cache_seqlens)
    capacity = inputs.block_table.shape[1] * PAGE_BLOCK_SIZE
    bad = np.flatnonzero((seqlens < 0) | (seqlens > capacity))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"cache_seqlens[{i}] = {int(seqlens[i])} is outside [0, {capacity}] "
                         f"(block_table has {inputs.block_table.shape[1]} blocks of {PAGE_BLOCK_SIZE} per request)")
    table = cupy.asnumpy(inputs.block_table)
    used = np.arange(table.shape[1])[None, :] < -(-seqlens[:, None] // PAGE_BLOCK_SIZE)
    ids = table[used]
    num_blocks = inputs.k_cache.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        rows, cols = np.nonzero(used & ((table < 0) | (table >= num_blocks)))
        raise ValueError(f"block_table[{rows[0]}, {cols[0]}] = {table[rows[0], cols[0]]} is not a block of "
                         f"k_cache (0 <= id < {num_blocks}) but request {rows[0]} uses it")
