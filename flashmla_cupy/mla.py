"""MLA decoding on CuPy arrays: the public functions, read top to bottom.

``get_mla_metadata`` runs the tile scheduler on the GPU; ``flash_mla_with_kvcache`` checks its
arguments, builds the TMA tensor maps and parameter structs, and launches the split-KV kernel
and then the combine kernel, both with Programmatic Dependent Launch, on CuPy's current stream.
The kernels are compiled by NVRTC on first use (cached on disk, see ``compiler``).
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from . import checks, launch, scheduler, tma
from .compiler import Program
from .params import CombineParams, MetadataParams, SplitKVParams, as_bytes, layout_defines

SPLITKV_THREADS = 256
COMBINE_WARPS = 8
_CTYPES = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t"}


def dtype_tag(dtype) -> str:
    return "fp16" if np.dtype(dtype) == np.float16 else "bf16"


def _splitkv_smem_bytes() -> int:
    """The split-KV kernel's SharedStorage (splitkv_traits.cuh; the compile checks they agree):
    Q and two pages of 64 x 576 16-bit values, P0 (64 x 64), five 64-float row vectors,
    19 mbarriers, padded to 1024 bytes."""
    tile = 64 * 64 * 2
    size = 3 * 9 * tile + tile + 5 * 64 * 4 + 19 * 8
    return -(-size // 1024) * 1024


SPLITKV_SMEM_BYTES = _splitkv_smem_bytes()


def splitkv_program(tag: str) -> Program:
    return Program(f"splitkv_mla<{tag}>", "mla/splitkv_kernel.cu",
                   (f"flashmla::splitkv_mla_kernel<{_CTYPES[tag]}>",),
                   layout_defines() + (("FLASHMLA_SPLITKV_SMEM_BYTES", str(SPLITKV_SMEM_BYTES)),))


def combine_program(tag: str) -> Program:
    return Program(f"mla_combine<{tag}>", "mla/combine_kernel.cu",
                   (f"flashmla::mla_combine_kernel<{_CTYPES[tag]}>",), layout_defines())


def metadata_program() -> Program:
    return Program("mla_metadata", "mla/metadata_kernel.cu", ("flashmla::mla_metadata_kernel",),
                   layout_defines())


def all_programs() -> list[Program]:
    """Every MLA kernel program (for ahead-of-time builds: ``flashmla-cupy compile``)."""
    return [splitkv_program("bf16"), splitkv_program("fp16"), combine_program("bf16"),
            combine_program("fp16"), metadata_program()]


def _kernel(program: Program) -> launch.Kernel:
    return launch.get_kernel(program, program.kernels[0])


def get_mla_metadata(cache_seqlens, num_heads_per_head_k: int, num_heads_k: int):
    """Tile-scheduler metadata for one batch of decoding requests.

    Args:
        cache_seqlens: int32 ``[batch]`` on the GPU, tokens in each request's KV cache.
        num_heads_per_head_k: query rows per KV head, ``s_q * h_q // h_kv``.
        num_heads_k: KV heads ``h_kv`` (1 for DeepSeek's MLA).

    Returns:
        ``(tile_scheduler_metadata, num_splits)``: int32 ``[num_sm_parts, 8]`` — per SM part,
        the (request, token) range it processes — and int32 ``[batch + 1]``, prefix sums of each
        request's number of splits. Compute it once per batch and pass it to every
        ``flash_mla_with_kvcache`` call (every layer) of that batch.
    """
    seqlens, heads_per_kv, h_kv = checks.metadata_inputs(cache_seqlens, num_heads_per_head_k, num_heads_k)
    device_id = cupy.cuda.runtime.getDevice()
    props = checks.require_hopper(device_id)
    parts = scheduler.num_sm_parts(props["sm_count"], heads_per_kv, h_kv)
    batch = seqlens.shape[0]
    metadata = cupy.empty((parts, scheduler.SCHED_META_INTS), dtype=np.int32)
    num_splits = cupy.empty((batch + 1,), dtype=np.int32)
    params = MetadataParams(seqlens=seqlens.data.ptr, sched_meta=metadata.data.ptr,
                            num_splits=num_splits.data.ptr, batch=batch,
                            block_n=scheduler.PAGE_BLOCK_SIZE,
                            fixed_overhead_blocks=scheduler.FIXED_OVERHEAD_BLOCKS, num_sm_parts=parts)
    _kernel(metadata_program()).launch((1, 1, 1), (32, 1, 1), as_bytes(params))
    return metadata, num_splits


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v: int,
                           tile_scheduler_metadata, num_splits, softmax_scale: float | None = None,
                           causal: bool = False, *, out=None, lse=None):
    """Paged MLA decoding attention (FlashMLA's interface) on CuPy arrays.

    Args:
        q: ``[batch, s_q, h_q, 576]``, ``ml_dtypes.bfloat16`` or ``float16``; s_q > 1 for MTP /
            speculative decoding.
        k_cache: ``[num_blocks, 64, h_kv, 576]``, q's dtype; pages of 64 tokens. V is its first
            512 columns (K and V share the latent).
        block_table: int32 ``[batch, max_blocks_per_seq]``, page ids of each request in order.
        cache_seqlens: int32 ``[batch]``, tokens per request (0 allowed).
        head_dim_v: 512.
        tile_scheduler_metadata, num_splits: from ``get_mla_metadata(cache_seqlens,
            s_q * h_q // h_kv, h_kv)`` of this batch.
        softmax_scale: default ``576 ** -0.5``.
        causal: with s_q > 1, query token i sees the first ``seqlen - (s_q - 1 - i)`` tokens.
        out, lse: optional preallocated outputs (C-contiguous, shapes and dtypes as returned);
            given, the results are written there and the same arrays are returned.

    Returns:
        ``(out, lse)``: ``[batch, s_q, h_q, 512]`` in q's dtype and float32 ``[batch, h_q, s_q]``
        (natural-log sum of exp of the scaled scores). A row that sees no token gets out = 0 and
        lse = +inf. Tokens at or past a request's length are never read into the result (their
        cache slots may hold anything, NaN included).

    q's head h attends with kv head ``h // (h_q // h_kv)``. Arrays exposing ``__dlpack__`` or
    ``__cuda_array_interface__`` are used zero-copy; outputs are CuPy arrays (new ones unless
    ``out``/``lse`` are given).
    """
    device_id = cupy.cuda.runtime.getDevice()
    props = checks.require_hopper(device_id)
    a = checks.mla_inputs(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                          num_splits, softmax_scale, causal, props)
    out_shape = (a.batch, a.s_q, a.h_q, checks.HEAD_DIM_V)
    lse_shape = (a.batch, a.h_q, a.s_q)
    if out is not None:
        out = checks.output_array(out, "out", out_shape, a.q.dtype)
    if lse is not None:
        lse = checks.output_array(lse, "lse", lse_shape, np.float32)
    tag = dtype_tag(a.q.dtype)
    splitkv = _kernel(splitkv_program(tag))
    combine = _kernel(combine_program(tag))

    # Query rows per kv head are (token, head-in-group) pairs: q as [b, q_rows, h_kv, 576].
    # With one kv head (DeepSeek) this is a view; otherwise a copy, and O is copied back.
    heads_per_kv, q_rows = a.heads_per_kv, a.q_rows
    if a.h_kv == 1:
        q_rows_view = cupy.ascontiguousarray(a.q).reshape(a.batch, q_rows, 1, checks.HEAD_DIM_K)
    else:
        q_rows_view = cupy.ascontiguousarray(
            a.q.reshape(a.batch, a.s_q, a.h_kv, heads_per_kv, checks.HEAD_DIM_K).transpose(0, 1, 3, 2, 4)
        ).reshape(a.batch, q_rows, a.h_kv, checks.HEAD_DIM_K)
    if out is None:
        out = cupy.empty(out_shape, dtype=a.q.dtype)
    if lse is None:
        lse = cupy.empty(lse_shape, dtype=np.float32)
    # With one kv head, O's rows are out itself.
    o_rows = out.reshape(a.batch, q_rows, 1, checks.HEAD_DIM_V) if a.h_kv == 1 else \
        cupy.empty((a.batch, q_rows, a.h_kv, checks.HEAD_DIM_V), dtype=a.q.dtype)
    total_splits = a.batch + a.num_sm_parts
    lse_accum = cupy.empty((total_splits, a.h_kv, q_rows), dtype=np.float32)
    o_accum = cupy.empty((total_splits, a.h_kv, q_rows, checks.HEAD_DIM_V), dtype=np.float32)

    params = SplitKVParams(
        block_table=a.block_table.data.ptr, seqlens=a.cache_seqlens.data.ptr,
        sched_meta=a.tile_scheduler_metadata.data.ptr, num_splits=a.num_splits.data.ptr,
        lse=lse.data.ptr, lse_accum=lse_accum.data.ptr, o_accum=o_accum.data.ptr,
        block_table_stride=a.block_table.strides[0] // 4, batch=a.batch, s_q=a.s_q, q_rows=q_rows,
        heads_per_kv=heads_per_kv, h_q=a.h_q, h_kv=a.h_kv, causal=int(a.causal),
        scale_log2=a.softmax_scale * math.log2(math.e))
    params.tma_q.bytes[:] = tma.rows_4d(q_rows_view)
    params.tma_kv.bytes[:] = tma.rows_4d(a.k_cache)
    params.tma_o.bytes[:] = tma.rows_4d(o_rows)
    num_m_blocks = -(-q_rows // scheduler.BLOCK_M)
    splitkv.launch((num_m_blocks, a.h_kv, a.num_sm_parts), (SPLITKV_THREADS, 1, 1), as_bytes(params),
                   smem=SPLITKV_SMEM_BYTES, pdl=True)

    combine_params = CombineParams(
        num_splits=a.num_splits.data.ptr, lse_accum=lse_accum.data.ptr, o_accum=o_accum.data.ptr,
        o=o_rows.data.ptr, lse=lse.data.ptr, batch=a.batch, q_rows=q_rows, h_kv=a.h_kv,
        heads_per_kv=heads_per_kv, s_q=a.s_q, h_q=a.h_q, max_splits=a.num_sm_parts)
    rows_per_batch = a.h_kv * q_rows
    combine.launch((a.batch, -(-rows_per_batch // COMBINE_WARPS), 1), (COMBINE_WARPS * 32, 1, 1),
                   as_bytes(combine_params), smem=COMBINE_WARPS * a.num_sm_parts * 4, pdl=True)

    if a.h_kv > 1:
        out.reshape(a.batch, a.s_q, a.h_kv, heads_per_kv, checks.HEAD_DIM_V)[...] = \
            o_rows.reshape(a.batch, a.s_q, heads_per_kv, a.h_kv, checks.HEAD_DIM_V).transpose(0, 1, 3, 2, 4)
    return out, lse

