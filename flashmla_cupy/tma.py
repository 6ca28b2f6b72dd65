"""TMA tensor maps (``CUtensorMap``) encoded on the host with ``cuTensorMapEncodeTiled``.

The kernels receive the 128 opaque bytes inside their ``__grid_constant__`` parameter struct.
Encoding costs several microseconds, so maps are cached by everything that defines them
(address, dtype, shape, strides, box); a decode loop that reuses its buffers encodes nothing.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from collections import OrderedDict

import numpy as np

from .driver import check, driver

_CACHE_SIZE = 256
_cache: OrderedDict[tuple, bytes] = OrderedDict()
_cache_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _data_type(dtype: np.dtype):
    import ml_dtypes

    drv = driver()
    types = {
        np.dtype(ml_dtypes.bfloat16): drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        np.dtype(np.float16): drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        np.dtype(np.float32): drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        np.dtype(np.uint8): drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
    }
    return types[np.dtype(dtype)]


def encode_tiled(address: int, dtype, dims: tuple[int, ...], strides_bytes: tuple[int, ...],
                 box: tuple[int, ...], l2_promotion: int = 128) -> bytes:
    """A tiled tensor map over ``dims`` (innermost first, that dimension contiguous), with the
    128-byte swizzle of the kernels' shared-memory tiles.

    ``strides_bytes`` are the byte strides of dims[1:], ``box`` the tile copied per TMA
    instruction. Out-of-bounds elements of a box read as zero and are not written on stores.
    ``l2_promotion``: the bytes (64, 128 or 256) that the L2 fetches from DRAM per request of a box.
    """
    key = (address, np.dtype(dtype).str, dims, strides_bytes, box, l2_promotion)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    drv = driver()
    rank = len(dims)
    tensor_map = check(drv.cuTensorMapEncodeTiled(
        _data_type(dtype), rank, address,
        [drv.cuuint64_t(d) for d in dims],
        [drv.cuuint64_t(s) for s in strides_bytes],
        [drv.cuuint32_t(b) for b in box],
        [drv.cuuint32_t(1)] * rank,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        getattr(drv.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_L2_{l2_promotion}B"),
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    ))
    raw = ctypes.string_at(tensor_map.getPtr(), 128)
    with _cache_lock:
        _cache[key] = raw
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return raw


def rows_4d_at(address: int, dtype, shape: tuple, strides_bytes: tuple,
               box_rows: int = 64, box_cols: int = 64, l2_promotion: int = 128) -> bytes:
    """Tensor map of a 4-D array ``[outer][rows][heads][cols]`` (last dim contiguous) at
    ``address``, given its shape and byte strides.

    Dims, innermost first: (cols, rows, heads, outer); the box covers box_rows x box_cols of one
    (outer, head). Used for Q ``[b][q_rows][h_kv][576]``, the KV cache
    ``[blocks][page_block_size][h_kv][576]`` and O ``[b][q_rows][h_kv][512]``.
    """
    outer, rows, heads, cols = shape
    s_outer, s_rows, s_heads, _ = strides_bytes
    return encode_tiled(address, dtype, (cols, rows, heads, outer), (s_rows, s_heads, s_outer),
                        (box_cols, box_rows, 1, 1), l2_promotion)
