"""Host mirrors of the kernel parameter structs in ``cuda_src/mla/params.cuh``.

Field for field, in the same order and with the same C types; ``tests/test_params.py`` parses
the C++ header and compares. The sizes are passed to NVRTC (``layout_defines``) and checked there
by ``static_assert``, so a drift between the two sides fails the compile, not the GPU.
"""
from __future__ import annotations

import ctypes

TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64


class TensorMap(ctypes.Structure):
    """Opaque 128-byte ``CUtensorMap`` (64-byte aligned on the device: it leads every struct)."""
    _fields_ = [("bytes", ctypes.c_ubyte * TENSOR_MAP_BYTES)]


class SplitKVParams(ctypes.Structure):
    _fields_ = [
        ("tma_q", TensorMap),
        ("tma_kv", TensorMap),
        ("block_table", ctypes.c_uint64),
        ("seqlens", ctypes.c_uint64),
        ("sched_meta", ctypes.c_uint64),
        ("num_splits", ctypes.c_uint64),
        ("lse", ctypes.c_uint64),
        ("lse_accum", ctypes.c_uint64),
        ("o_accum", ctypes.c_uint64),
        ("o", ctypes.c_uint64),
        ("error", ctypes.c_uint64),
        ("indices", ctypes.c_uint64),
        ("topk_length", ctypes.c_uint64),
        ("attn_sink", ctypes.c_uint64),
        ("cache", ctypes.c_uint64),
        ("kv_scale", ctypes.c_uint64),
        ("q_scale", ctypes.c_uint64),
        ("block_table_stride", ctypes.c_int64),
        ("max_blocks_per_seq", ctypes.c_int32),
        ("num_blocks", ctypes.c_int32),
        ("total_splits", ctypes.c_int32),
        ("batch", ctypes.c_int32),
        ("s_q", ctypes.c_int32),
        ("q_rows", ctypes.c_int32),
        ("heads_per_kv", ctypes.c_int32),
        ("h_q", ctypes.c_int32),
        ("h_kv", ctypes.c_int32),
        ("causal", ctypes.c_int32),
        ("scale_log2", ctypes.c_float),
        ("indices_stride_b", ctypes.c_int64),
        ("indices_stride_s", ctypes.c_int64),
        ("cache_block_stride", ctypes.c_int64),
        ("cache_head_stride", ctypes.c_int64),
        ("cache_tokens", ctypes.c_int64),
        ("topk", ctypes.c_int32),
        ("page_block_size", ctypes.c_int32),
        ("page_shift", ctypes.c_int32),
        ("piece_shift", ctypes.c_int32),
        ("sparse_s_q", ctypes.c_int32),
    ]


class CombineParams(ctypes.Structure):
    _fields_ = [
        ("num_splits", ctypes.c_uint64),
        ("lse_accum", ctypes.c_uint64),
        ("o_accum", ctypes.c_uint64),
        ("o", ctypes.c_uint64),
        ("lse", ctypes.c_uint64),
        ("error", ctypes.c_uint64),
        ("attn_sink", ctypes.c_uint64),
        ("batch", ctypes.c_int32),
        ("q_rows", ctypes.c_int32),
        ("h_kv", ctypes.c_int32),
        ("heads_per_kv", ctypes.c_int32),
        ("s_q", ctypes.c_int32),
        ("h_q", ctypes.c_int32),
        ("max_splits", ctypes.c_int32),
        ("total_splits", ctypes.c_int32),
        ("sparse_s_q", ctypes.c_int32),
    ]


class MetadataParams(ctypes.Structure):
    _fields_ = [
        ("seqlens", ctypes.c_uint64),
        ("sched_meta", ctypes.c_uint64),
        ("num_splits", ctypes.c_uint64),
        ("error", ctypes.c_uint64),
        ("batch", ctypes.c_int32),
        ("block_n", ctypes.c_int32),
        ("fixed_overhead_blocks", ctypes.c_int32),
        ("num_sm_parts", ctypes.c_int32),
        ("uniform_seqlen", ctypes.c_int32),
    ]


def device_sizeof(struct: type[ctypes.Structure]) -> int:
    """``sizeof`` on the device: a struct holding a TensorMap is padded to 64-byte alignment."""
    size = ctypes.sizeof(struct)
    has_map = any(t is TensorMap for _, t in struct._fields_)
    align = TENSOR_MAP_ALIGN if has_map else ctypes.alignment(struct)
    return -(-size // align) * align


def layout_defines() -> tuple[tuple[str, str], ...]:
    """``-D`` definitions that let the device code check the host layouts."""
    return (
        ("FLASHMLA_SPLITKV_PARAMS_BYTES", str(device_sizeof(SplitKVParams))),
        ("FLASHMLA_COMBINE_PARAMS_BYTES", str(device_sizeof(CombineParams))),
        ("FLASHMLA_METADATA_PARAMS_BYTES", str(device_sizeof(MetadataParams))),
    )

