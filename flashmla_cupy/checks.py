"""Argument validation shared by the public functions: it only checks and prepares.

Every check runs before anything is allocated or launched and never writes to the caller's
arrays. Errors are ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong
device, shape, layout or value); each message starts with the argument's name, then says what
was expected, then what was given. Devices other than Hopper raise ``UnsupportedDeviceError``
before any compilation.

Helpers:

* ``device_view(x, name, what)``: ``x`` as a CuPy array without a copy (CuPy arrays, and objects
  exposing ``__dlpack__`` or ``__cuda_array_interface__``); refuses host memory and non-arrays.
  It does not look at which GPU the array is on: ``require_current_device`` does, and
  ``as_device_array`` is the two together.
* ``require_dtype``, ``require_ndim``, ``require_contiguous``, ``require_last_dim_contiguous``,
  ``require_int``, ``require_bool``, ``checked_softmax_scale``, ``require_hopper``.
* ``metadata_inputs``, ``mla_inputs``, ``output_array``: all the host-side checks of
  ``get_mla_metadata`` and ``flash_mla_with_kvcache``.

The *values* inside the integer arrays (sequence lengths, block ids) are not read here: that
would synchronize with the GPU. The kernels check them and report through ``errors``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import cupy
import numpy as np

from . import interop, quant, scheduler
from .constants import HEAD_DIM_K, HEAD_DIM_V, SCHED_META_INTS

_DLPACK_CUDA_DEVICES = (2, 13)    # kDLCUDA, kDLCUDAManaged (kDLCUDAHost, 3, is pinned host memory)
_CUDA_DEVICE_MEMORY = (cupy.cuda.runtime.memoryTypeDevice, cupy.cuda.runtime.memoryTypeManaged)


class UnsupportedDeviceError(RuntimeError):
    """The current GPU cannot run these kernels (they need Hopper, sm_90)."""


# --------------------------------------------------------------------------------------------
# Arrays
# --------------------------------------------------------------------------------------------

def device_view(x, name: str, what: str = "a GPU array") -> cupy.ndarray:
    """A CuPy view of ``x``, zero-copy for foreign GPU arrays; ``TypeError`` for anything else.

    Accepts CuPy arrays and objects exposing ``__dlpack__`` (PyTorch, JAX, ...) or
    ``__cuda_array_interface__`` in device (or managed) memory. ``what`` describes the expected
    array in the message, e.g. "a float32 GPU array [B, H, N, d]".
    """
    if isinstance(x, cupy.ndarray):
        return x
    expected = (f"{name} must be {what} (CuPy, or an object with __dlpack__ or "
                f"__cuda_array_interface__ in device memory)")
    kind = f"{type(x).__module__}.{type(x).__qualname__}"
    if isinstance(x, np.ndarray):
        raise TypeError(f"{expected}; got a NumPy array in host memory (copy it first: cupy.asarray({name}))")
    tensor = interop.torch_tensor_type()
    dtype = interop.numpy_dtype_of_torch(x.dtype) if tensor is not None and isinstance(x, tensor) else None
    if dtype is not None and x.is_cuda:
        # Viewed directly: DLPack's stream handshake would join a stream that torch may be
        # capturing into a graph. Callers order the streams themselves (mla.py).
        return interop.device_view_of(x.data_ptr(), tuple(x.shape), dtype, x, x.get_device(),
                                      strides=tuple(s * x.element_size() for s in x.stride()))
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type = int(x.__dlpack_device__()[0])
        if device_type not in _DLPACK_CUDA_DEVICES:
            raise TypeError(f"{expected}; got a {kind} whose DLPack device type is {device_type} "
                            f"(not CUDA device memory)")
        return cupy.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        address = x.__cuda_array_interface__["data"][0]
        if address:                 # 0 for an empty array
            memory_type = cupy.cuda.runtime.pointerGetAttributes(address).type
            if memory_type not in _CUDA_DEVICE_MEMORY:
                raise TypeError(f"{expected}; got a {kind} whose __cuda_array_interface__ points to "
                                f"host memory (address {address:#x}, CUDA memory type {memory_type})")
        return cupy.asarray(x)
    raise TypeError(f"{expected}; got {kind}")


def require_current_device(arr: cupy.ndarray, name: str) -> None:
    current = cupy.cuda.runtime.getDevice()
    if arr.device.id != current:
        raise ValueError(f"{name} must be on CuPy's current device {current}; got an array on device "
                         f"{arr.device.id} (call under `with cupy.cuda.Device({arr.device.id}):` or move it)")


def as_device_array(x, name: str) -> cupy.ndarray:
    """``device_view`` of ``x``, which must be on CuPy's current device."""
    arr = device_view(x, name)
    require_current_device(arr, name)
    return arr


def require_dtype(arr, name: str, allowed) -> None:
    allowed = [np.dtype(a) for a in allowed]
    if arr.dtype not in allowed:
        expected = " or ".join(a.name for a in allowed)
        raise TypeError(f"{name} must have dtype {expected}; got {arr.dtype.name}")


def require_ndim(arr, name: str, ndim: int, layout: str) -> None:
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}; got {arr.ndim}-D shape {tuple(arr.shape)}")


def require_last_dim_contiguous(arr, name: str) -> None:
    if arr.shape[-1] > 1 and arr.strides[-1] != arr.itemsize:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {arr.itemsize} bytes); "
                         f"got strides {arr.strides} for shape {tuple(arr.shape)}")


def require_contiguous(arr, name: str) -> None:
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous; got strides {arr.strides} for shape {tuple(arr.shape)}")


# --------------------------------------------------------------------------------------------
# Scalars and the device
# --------------------------------------------------------------------------------------------

def require_int(value, name: str, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return int(value)


def require_bool(value, name: str) -> bool:
    # A strict bool: a string such as "false" would otherwise count as True.
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__} {value!r}")
    return bool(value)


def checked_softmax_scale(value, default: float, positive: bool) -> float:
    """``value`` (``default`` for None) as a float that is finite in float32 (and > 0 if
    ``positive``)."""
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None; got {type(value).__name__} {value!r}")
    if not abs(value) <= float(np.finfo(np.float32).max) or (positive and value <= 0):   # NaN fails <=
        raise ValueError(f"softmax_scale must be {'positive and ' if positive else ''}finite in float32; "
                         f"got {value!r}")
    return float(value)


def require_hopper(device_id: int) -> dict:
    """The device's properties (``driver.device_properties``) if it is a Hopper GPU."""
    from .driver import device_properties

    props = device_properties(device_id)
    if props["major"] != 9:
        raise UnsupportedDeviceError(
            f"the current device must be a Hopper GPU (sm_90: H100, H200, H800, H20) for flashmla-cupy's "
            f"MLA kernels; got device {device_id}, {props['name']} (sm_{props['major']}{props['minor']})")
    return props


def bfloat16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def out_dtype(q_dtype) -> np.dtype:
    """The output's dtype (and the kernels' 16-bit one) for q of ``q_dtype``: q's own, bf16 for an
    e4m3 q (its bytes)."""
    return bfloat16() if np.dtype(q_dtype).name in quant.BYTE_DTYPES else np.dtype(q_dtype)


def require_fp8_cache(k_cache, what: str) -> None:
    if k_cache.dtype.name not in quant.BYTE_DTYPES:
        raise TypeError(f"k_cache must hold {what} (uint8, int8 or float8_e4m3fn); got {k_cache.dtype.name}")


def fp8_scale(x, name: str) -> cupy.ndarray:
    """A dequantization scale: one float32 on the GPU (shape () or (1,)), read by the kernel."""
    arr = as_device_array(x, name)
    require_dtype(arr, name, [np.float32])
    if arr.size != 1 or arr.ndim > 1:
        raise ValueError(f"{name} must hold one float32 (shape () or (1,)); got shape {tuple(arr.shape)}")
    return arr


# --------------------------------------------------------------------------------------------
# get_mla_metadata
# --------------------------------------------------------------------------------------------

def metadata_inputs(cache_seqlens, num_heads_per_head_k, num_heads_k) -> tuple[cupy.ndarray, int, int, dict]:
    """Checked arguments of get_mla_metadata, and the (Hopper) device's properties."""
    seqlens = as_device_array(cache_seqlens, "cache_seqlens")
    require_dtype(seqlens, "cache_seqlens", [np.int32])
    require_ndim(seqlens, "cache_seqlens", 1, "[batch]")
    if seqlens.shape[0] == 0:
        raise ValueError("cache_seqlens must hold at least one request (batch >= 1); got shape (0,)")
    require_contiguous(seqlens, "cache_seqlens")
    heads_per_kv = require_int(num_heads_per_head_k, "num_heads_per_head_k", 1)
    h_kv = require_int(num_heads_k, "num_heads_k", 1)
    props = require_hopper(cupy.cuda.runtime.getDevice())
    return seqlens, heads_per_kv, h_kv, props


def metadata_outputs(out, batch: int, parts: int) -> tuple[cupy.ndarray, cupy.ndarray]:
    """get_mla_metadata's ``out=(tile_scheduler_metadata, num_splits)``: int32 arrays of shapes
    ``(parts, 8)`` and ``(batch + 1,)``, C-contiguous, on the current device."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out must be a pair (tile_scheduler_metadata, num_splits); got {type(out).__name__}")
    meta = output_array(out[0], "out[0] (tile_scheduler_metadata)", (parts, SCHED_META_INTS), np.int32)
    splits = output_array(out[1], "out[1] (num_splits)", (batch + 1,), np.int32)
    return meta, splits


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
    k_scale: cupy.ndarray | None             # the FP8 cache's scale; None: a 16-bit cache
    q_scale: cupy.ndarray | None             # an e4m3 q's scale (FP8 cache only); None: q in 16 bits
    batch: int
    s_q: int
    h_q: int
    h_kv: int
    softmax_scale: float
    causal: bool
    num_sm_parts: int
    # layout facts the kernels' host side needs, kept when the arrays are dropped
    dtype: np.dtype | None = None             # out's (and the kernels' 16-bit) dtype: q's, bf16 for an e4m3 q
    q_dtype: np.dtype | None = None
    q_strides: tuple | None = None            # bytes
    k_cache_shape: tuple | None = None
    k_cache_strides: tuple | None = None      # bytes
    block_table_stride: int | None = None     # elements
    block_table_columns: int | None = None
    fp8_cache: bool = False
    fp8_q: bool = False

    def __post_init__(self):
        if self.q is not None:
            self.q_dtype = self.q.dtype
            self.fp8_q = self.q_scale is not None
            self.dtype = out_dtype(self.q.dtype)
            self.q_strides = tuple(self.q.strides)
            self.k_cache_shape, self.k_cache_strides = tuple(self.k_cache.shape), tuple(self.k_cache.strides)
            self.block_table_stride = self.block_table.strides[0] // self.block_table.itemsize
            self.block_table_columns = self.block_table.shape[1]
            self.fp8_cache = self.k_scale is not None

    @property
    def heads_per_kv(self) -> int:
        return self.h_q // self.h_kv

    @property
    def q_rows(self) -> int:
        return self.s_q * self.heads_per_kv


def mla_inputs(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
               num_splits, softmax_scale, causal, k_scale=None, q_scale=None) -> MLAInputs:
    """Checked arguments of flash_mla_with_kvcache (the device must be a Hopper GPU); ``k_scale``
    given: the dense FP8 cache (e4m3 values), with bf16 q or, ``q_scale`` given, e4m3 q."""
    q = as_device_array(q, "q")
    k_cache = as_device_array(k_cache, "k_cache")
    block_table = as_device_array(block_table, "block_table")
    cache_seqlens = as_device_array(cache_seqlens, "cache_seqlens")
    tile_scheduler_metadata = as_device_array(tile_scheduler_metadata, "tile_scheduler_metadata")
    num_splits = as_device_array(num_splits, "num_splits")

    fp8 = k_scale is not None
    if fp8:
        k_scale = fp8_scale(k_scale, "k_scale")
        if q_scale is None:
            if q.dtype.name in quant.BYTE_DTYPES:
                raise ValueError(f"q holds e4m3 values ({q.dtype.name}): pass its dequantization scale as q_scale "
                                 f"(a float32 GPU array of one element)")
            require_dtype(q, "q (with the FP8 cache; or e4m3 values with q_scale)", [bfloat16()])
        else:
            q_scale = fp8_scale(q_scale, "q_scale")
            if q.dtype.name not in quant.BYTE_DTYPES:
                raise TypeError(f"q must hold e4m3 values (uint8, int8 or float8_e4m3fn) with q_scale; got "
                                f"{q.dtype.name} (a bf16 q takes no q_scale)")
        require_fp8_cache(k_cache, "the FP8 cache's e4m3 values")
    else:
        require_dtype(q, "q", [bfloat16(), np.float16])
        if k_cache.dtype != q.dtype:
            raise TypeError(f"k_cache must have q's dtype {q.dtype.name}; got {k_cache.dtype.name}")
    for arr, name in ((block_table, "block_table"), (cache_seqlens, "cache_seqlens"),
                      (tile_scheduler_metadata, "tile_scheduler_metadata"), (num_splits, "num_splits")):
        require_dtype(arr, name, [np.int32])

    require_ndim(q, "q", 4, "[batch, s_q, h_q, 576]")
    require_ndim(k_cache, "k_cache", 4, "[num_blocks, page_block_size, h_kv, 576]")
    require_ndim(block_table, "block_table", 2, "[batch, max_blocks_per_seq]")
    require_ndim(cache_seqlens, "cache_seqlens", 1, "[batch]")

    batch, s_q, h_q, d = q.shape
    num_blocks, page, h_kv, d_k = k_cache.shape
    if d != HEAD_DIM_K:
        raise ValueError(f"q must have head dim (axis 3) {HEAD_DIM_K}; got shape {tuple(q.shape)}")
    if d_k != HEAD_DIM_K:
        raise ValueError(f"k_cache must have head dim (axis 3) {HEAD_DIM_K}; got shape {tuple(k_cache.shape)}")
    if require_int(head_dim_v, "head_dim_v", 1) != HEAD_DIM_V:
        raise ValueError(f"head_dim_v must be {HEAD_DIM_V}; got {head_dim_v}")
    if page & (page - 1):                  # 0 is caught below, with num_blocks
        raise ValueError(f"k_cache must have a power-of-two page block size (axis 1: 1, 2, 4, ..., 64, 128, ...); "
                         f"got shape {tuple(k_cache.shape)}")
    if batch == 0:
        raise ValueError(f"q must hold at least one request (batch, axis 0, >= 1); got shape {tuple(q.shape)}")
    if s_q == 0:
        raise ValueError(f"q must hold at least one query token (s_q, axis 1, >= 1); got shape {tuple(q.shape)}")
    if num_blocks == 0 or page == 0 or h_kv == 0:
        raise ValueError(f"k_cache must hold at least one block (axis 0) of at least one token (axis 1) "
                         f"and one head (axis 2); "
                         f"got shape {tuple(k_cache.shape)}")
    if h_q == 0 or h_q % h_kv:
        raise ValueError(f"q must have a positive multiple of k_cache's {h_kv} heads (axis 2); "
                         f"got shape {tuple(q.shape)}")
    if fp8 and h_kv != 1:
        raise ValueError(f"k_cache (FP8) must have one head (axis 2; MLA's latent cache); got shape {tuple(k_cache.shape)}")
    if block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(f"block_table must have one row per request ({batch}) and at least one column; "
                         f"got shape {tuple(block_table.shape)}")
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens must have shape ({batch},), one entry per request; "
                         f"got {tuple(cache_seqlens.shape)}")

    q_rows = s_q * (h_q // h_kv)
    device_props = require_hopper(cupy.cuda.runtime.getDevice())
    parts = scheduler.num_sm_parts(device_props["sm_count"], q_rows, h_kv)
    if tile_scheduler_metadata.shape != (parts, SCHED_META_INTS):
        raise ValueError(
            f"tile_scheduler_metadata must have shape ({parts}, {SCHED_META_INTS}), from "
            f"get_mla_metadata(cache_seqlens, s_q * h_q // h_kv = {q_rows}, h_kv = {h_kv}) on this device; "
            f"got {tuple(tile_scheduler_metadata.shape)}")
    if num_splits.shape != (batch + 1,):
        raise ValueError(f"num_splits must have shape ({batch + 1},) (batch + 1, from get_mla_metadata "
                         f"of this batch); got {tuple(num_splits.shape)}")

    require_last_dim_contiguous(q, "q")
    require_last_dim_contiguous(k_cache, "k_cache")
    require_last_dim_contiguous(block_table, "block_table")
    for arr, name in ((cache_seqlens, "cache_seqlens"), (tile_scheduler_metadata, "tile_scheduler_metadata"),
                      (num_splits, "num_splits")):
        require_contiguous(arr, name)
    if fp8 and k_cache.strides[1] != HEAD_DIM_K and page > 1:
        raise ValueError(f"k_cache (FP8)'s tokens must be contiguous rows of {HEAD_DIM_K} bytes "
                         f"(strides (*, {HEAD_DIM_K}, *, 1)); got strides {k_cache.strides}")
    # TMA: 16-byte aligned base and strides (q: base; other strides are handled by a copy). The
    # FP8 cache is read by 16-byte loads: the same rule.
    if k_cache.data.ptr % 16 or any(s % 16 for s in k_cache.strides[:3]):
        raise ValueError(f"k_cache must start on a 16-byte boundary with 16-byte-multiple strides (TMA); "
                         f"got address {k_cache.data.ptr:#x}, strides {k_cache.strides}")
    if q.data.ptr % 16:
        raise ValueError(f"q must start on a 16-byte boundary (TMA); got address {q.data.ptr:#x}")

    scale = checked_softmax_scale(softmax_scale, HEAD_DIM_K ** -0.5, positive=True)
    if scale * math.log2(math.e) > float(np.finfo(np.float32).max):     # the kernels use scale * log2(e)
        raise ValueError(f"softmax_scale must be at most float32 max / log2(e); got {softmax_scale!r}")
    causal = require_bool(causal, "causal")

    return MLAInputs(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits, k_scale,
                     q_scale, batch, s_q, h_q, h_kv, scale, causal and s_q > 1, parts)


def output_array(x, name: str, shape: tuple, dtype) -> cupy.ndarray:
    """A caller-provided output: a C-contiguous GPU array of exactly this shape and dtype."""
    arr = as_device_array(x, name)
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(arr.shape)}")
    require_dtype(arr, name, [dtype])
    require_contiguous(arr, name)
    return arr
