"""DeepSeek-V3.2's sparse decoding over the FP8 KV cache: checks and call plans.

``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)`` lands here. The split-KV kernel
runs in its sparse form (``programs.SPARSE_FP8_TAG``): every query token is a request of its own
(``b * s_q`` requests of ``h_q`` rows), whose "pages" are 64 consecutive entries of its index
list; a producer warpgroup gathers and dequantizes the tokens they name. The scheduler metadata
comes from ``get_mla_metadata(..., topk=topk)``, which schedules every request as ``topk`` long.
The combine kernel and the workspace are the dense path's.
"""
from __future__ import annotations

import dataclasses
import math
import struct

import cupy
import numpy as np

from . import checks, errors, launch, programs, scheduler
from .constants import BLOCK_M, COMBINE_WARPS, FP8_TOKEN_BYTES, HEAD_DIM_K, HEAD_DIM_V, SCHED_META_INTS, \
    PRODUCER_THREADS, SPLITKV_THREADS
from .params import CombineParams, SplitKVParams
from .plan import COMBINE_POINTERS, SPLITKV_POINTERS, LaunchPlan, TensorMapField, pointer_run


@dataclasses.dataclass(frozen=True)
class SparseInputs:
    """Checked sizes of a sparse call (no arrays: a plan must not keep the cache alive)."""
    batch: int
    s_q: int
    h_q: int
    topk: int
    num_blocks: int
    page_block_size: int
    cache_block_stride: int          # bytes
    indices_strides: tuple           # elements (batch, s_q)
    q_strides: tuple                 # bytes
    softmax_scale: float
    num_sm_parts: int
    has_topk_length: bool
    has_attn_sink: bool

    @property
    def requests(self) -> int:       # every query token is a request of the kernel
        return self.batch * self.s_q

    h_kv = 1                         # the dense call's names, for LaunchPlan's copy of q

    @property
    def heads_per_kv(self) -> int:
        return self.h_q


def _optional(x, name: str, dtype, shape: tuple):
    if x is None:
        return None
    arr = checks.as_device_array(x, name)
    checks.require_dtype(arr, name, [dtype])
    if tuple(arr.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}; got {tuple(arr.shape)}")
    checks.require_contiguous(arr, name)
    return arr


def sparse_inputs(q, k_cache, head_dim_v, metadata, num_splits, softmax_scale, causal, is_fp8_kvcache,
                  indices, attn_sink, topk_length) -> SparseInputs:
    """The checked sizes of a sparse call (every argument checked but for the values inside)."""
    if is_fp8_kvcache is not True:
        raise ValueError("indices (sparse decoding) needs the FP8 cache: pass is_fp8_kvcache=True "
                         f"(k_cache [num_blocks, page_block_size, 1, {FP8_TOKEN_BYTES}] bytes); got {is_fp8_kvcache!r}")
    if checks.require_bool(causal, "causal"):
        raise ValueError("causal must be False with indices (sparse decoding): the indices say what each token sees")
    q = checks.as_device_array(q, "q")
    k_cache = checks.as_device_array(k_cache, "k_cache")
    indices = checks.as_device_array(indices, "indices")
    metadata = checks.as_device_array(metadata, "tile_scheduler_metadata")
    num_splits = checks.as_device_array(num_splits, "num_splits")

    checks.require_dtype(q, "q", [checks.bfloat16()])
    checks.require_fp8_cache(k_cache, "the FP8 cache's bytes")
    checks.require_dtype(indices, "indices", [np.int32])
    checks.require_ndim(q, "q", 4, "[batch, s_q, h_q, 576]")
    checks.require_ndim(k_cache, "k_cache", 4, f"[num_blocks, page_block_size, 1, {FP8_TOKEN_BYTES}]")
    checks.require_ndim(indices, "indices", 3, "[batch, s_q, topk]")
    batch, s_q, h_q, d = q.shape
    num_blocks, page, h_kv, width = k_cache.shape
    if d != HEAD_DIM_K:
        raise ValueError(f"q must have head dim (axis 3) {HEAD_DIM_K}; got shape {tuple(q.shape)}")
    if width != FP8_TOKEN_BYTES or h_kv != 1:
        raise ValueError(f"k_cache must be [num_blocks, page_block_size, 1, {FP8_TOKEN_BYTES}] (one KV head, "
                         f"{FP8_TOKEN_BYTES} bytes per token); got shape {tuple(k_cache.shape)}")
    if 0 in (batch, s_q, h_q):
        raise ValueError(f"q must have batch, s_q and h_q (axes 0-2) >= 1; got shape {tuple(q.shape)}")
    if num_blocks == 0 or page == 0:
        raise ValueError(f"k_cache must hold at least one block of at least one token; got shape {tuple(k_cache.shape)}")
    if checks.require_int(head_dim_v, "head_dim_v", 1) != HEAD_DIM_V:
        raise ValueError(f"head_dim_v must be {HEAD_DIM_V}; got {head_dim_v}")
    if indices.shape[:2] != (batch, s_q) or indices.shape[2] == 0:
        raise ValueError(f"indices must have shape ({batch}, {s_q}, topk) with topk >= 1; got {tuple(indices.shape)}")
    topk = indices.shape[2]
    topk_length = _optional(topk_length, "topk_length", np.int32, (batch,))
    attn_sink = _optional(attn_sink, "attn_sink", np.float32, (h_q,))

    checks.require_last_dim_contiguous(q, "q")
    checks.require_last_dim_contiguous(indices, "indices")
    if k_cache.strides[3] != 1 or k_cache.strides[1] != FP8_TOKEN_BYTES:
        raise ValueError(f"k_cache's tokens must be contiguous rows of {FP8_TOKEN_BYTES} bytes "
                         f"(strides (*, {FP8_TOKEN_BYTES}, *, 1)); got strides {k_cache.strides}")
    if k_cache.data.ptr % 16 or k_cache.strides[0] % 16:
        raise ValueError(f"k_cache must start on a 16-byte boundary with a 16-byte-multiple block stride; "
                         f"got address {k_cache.data.ptr:#x}, strides {k_cache.strides}")
    if q.data.ptr % 16 or any(st % 16 for st in q.strides[:3]):
        raise ValueError(f"q must start on a 16-byte boundary with 16-byte-multiple strides (TMA); "
                         f"got address {q.data.ptr:#x}, strides {q.strides}")

    parts = scheduler.num_sm_parts(checks.require_hopper(cupy.cuda.runtime.getDevice())["sm_count"], h_q, 1)
    if metadata.shape != (parts, SCHED_META_INTS) or metadata.dtype != np.int32:
        raise ValueError(f"tile_scheduler_metadata must be int32 ({parts}, {SCHED_META_INTS}), from get_mla_metadata("
                         f"cache_seqlens, s_q * h_q = {s_q * h_q}, 1, num_heads_q={h_q}, is_fp8_kvcache=True, "
                         f"topk={topk}); got {metadata.dtype.name} {tuple(metadata.shape)}")
    if num_splits.shape != (batch * s_q + 1,) or num_splits.dtype != np.int32:
        raise ValueError(f"num_splits must be int32 ({batch * s_q + 1},) (batch * s_q + 1, from get_mla_metadata "
                         f"with topk=...); got {num_splits.dtype.name} {tuple(num_splits.shape)}")
    checks.require_contiguous(metadata, "tile_scheduler_metadata")
    checks.require_contiguous(num_splits, "num_splits")
    scale = checks.checked_softmax_scale(softmax_scale, HEAD_DIM_K ** -0.5, positive=True)
    if scale * math.log2(math.e) > float(np.finfo(np.float32).max):
        raise ValueError(f"softmax_scale must be at most float32 max / log2(e); got {softmax_scale!r}")

    return SparseInputs(batch, s_q, h_q, topk, num_blocks, page, k_cache.strides[0],
                        (indices.strides[0] // 4, indices.strides[1] // 4), tuple(q.strides), scale, parts,
                        topk_length is not None, attn_sink is not None)


# The sparse kernels' pointer fields: the dense ones (block_table and seqlens unused) and theirs.
_SPLITKV_POINTERS = pointer_run(SplitKVParams, SPLITKV_POINTERS + ("indices", "topk_length", "attn_sink", "cache"))
_COMBINE_POINTERS = pointer_run(CombineParams, COMBINE_POINTERS + ("attn_sink",))


class SparsePlan(LaunchPlan):
    """Prebuilt launches of one sparse call layout (device, stream, shapes, strides)."""

    workspace_call = "get_mla_workspace(q, k_cache, tile_scheduler_metadata, sparse=True)"

    def __init__(self, a: SparseInputs, stream_ptr: int, family: str):
        self.inputs = a
        # The kernel sees q as [requests][h_q][1][576]: in place when (batch, s_q) merge evenly,
        # else copied into the workspace in that layout.
        s_b, s_s, s_h, _ = a.q_strides
        self.q_in_place = a.s_q == 1 or s_b == a.s_q * s_s
        rows = (a.requests, a.h_q, 1, HEAD_DIM_K)
        q_strides = (s_s if a.s_q > 1 else s_b, s_h, s_h * a.h_q, 2) if self.q_in_place else \
            (a.h_q * HEAD_DIM_K * 2, HEAD_DIM_K * 2, a.h_q * HEAD_DIM_K * 2, 2)
        super().__init__(stream_ptr, family, checks.bfloat16(), (a.batch, a.s_q, a.h_q, HEAD_DIM_V),
                         (a.batch, a.h_q, a.s_q), (a.requests, 1, a.h_q, 1, a.num_sm_parts),
                         [TensorMapField(SplitKVParams.tma_q.offset, rows, q_strides, BLOCK_M)])

    def _prepare_launches(self) -> None:
        a = self.inputs
        m_blocks = -(-a.h_q // BLOCK_M)
        # m-blocks pair up in clusters of two CTAs that share the dequantized pages (fp8_producer.cuh);
        # a CTA alone has a kernel of its own
        pairs = programs.sparse_pairs(a.h_q)
        splitkv = launch.get_kernel(programs.splitkv_program(programs.SPARSE_FP8_TAG, alone=not pairs))
        combine = launch.get_kernel(programs.combine_program("bf16"))
        self.splitkv = splitkv.prepare((m_blocks, 1, a.num_sm_parts),
                                       (SPLITKV_THREADS + PRODUCER_THREADS, 1, 1), SplitKVParams,
                                       smem=programs.SPLITKV_SMEM_BYTES, stream=self.stream_ptr, pdl=True,
                                       cluster_x=2 if pairs else 1)
        p = self.splitkv.params
        p.total_splits, p.batch, p.s_q, p.q_rows, p.heads_per_kv = a.requests + a.num_sm_parts, a.requests, 1, a.h_q, a.h_q
        p.h_q, p.h_kv, p.causal, p.scale_log2 = a.h_q, 1, 0, a.softmax_scale * math.log2(math.e)
        p.indices_stride_b, p.indices_stride_s = a.indices_strides
        p.cache_block_stride, p.cache_tokens = a.cache_block_stride, a.num_blocks * a.page_block_size
        p.topk, p.page_block_size, p.sparse_s_q = a.topk, a.page_block_size, a.s_q
        p.num_blocks, p.max_blocks_per_seq = a.num_blocks, 1
        self.combine = combine.prepare((a.requests, -(-a.h_q // COMBINE_WARPS), 1), (COMBINE_WARPS * 32, 1, 1),
                                       CombineParams, smem=COMBINE_WARPS * a.num_sm_parts * 4,
                                       stream=self.stream_ptr, pdl=True)
        c = self.combine.params
        c.batch, c.q_rows, c.h_kv, c.heads_per_kv, c.s_q, c.h_q = a.requests, a.h_q, 1, a.h_q, 1, a.h_q
        c.max_splits, c.total_splits, c.sparse_s_q = a.num_sm_parts, a.requests + a.num_sm_parts, a.s_q

    def run(self, pointers, q, out, lse, workspace):
        """Launch both kernels for arrays of this plan's layout at ``pointers`` (q, k_cache,
        indices, metadata, num_splits, topk_length, attn_sink; 0 where absent)."""
        out, out_ptr, lse, lse_ptr, ws = self._begin_run(out, lse, workspace)
        q_ptr, cache_ptr, indices_ptr, meta_ptr, splits_ptr, topk_length_ptr, sink_ptr = pointers
        error_ptr = errors.kernel_pointer(self.record)
        with self._lock:
            if not self.q_in_place:
                q_ptr = self._copy_q_rows(q_ptr, q, ws)
            self._update_map(0, q_ptr)
            lse_accum_ptr, o_accum_ptr = ws.lse_accum_ptr, ws.o_accum_ptr
            offset, fmt = _SPLITKV_POINTERS
            struct.pack_into(fmt, self.splitkv.buffer, offset, 0, 0, meta_ptr, splits_ptr, lse_ptr, lse_accum_ptr,
                             o_accum_ptr, out_ptr, error_ptr, indices_ptr, topk_length_ptr, sink_ptr, cache_ptr)
            self.splitkv()
            offset, fmt = _COMBINE_POINTERS
            struct.pack_into(fmt, self.combine.buffer, offset, splits_ptr, lse_accum_ptr, o_accum_ptr, out_ptr,
                             lse_ptr, error_ptr, sink_ptr)
            self.combine()
        errors.after_launch(self.record, self.stream_ptr)
        return out, lse
