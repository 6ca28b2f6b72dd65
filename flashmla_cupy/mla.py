"""MLA decoding: the public functions, read top to bottom.

``get_mla_metadata`` runs the tile scheduler on the GPU; ``flash_mla_with_kvcache`` finds (or
builds, after checking the arguments) the call plan for its arguments' layout and launches the
split-KV kernel and then the combine kernel, both with Programmatic Dependent Launch. Neither
waits for the GPU: the values inside the integer arrays are checked by the kernels, which
report a bad one through ``errors`` (raised by a later call, or at once in "sync" mode).
Work runs on CuPy's current device, on ``stream`` (default: CuPy's current stream).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import cupy
import numpy as np

from . import checks, errors, interop, launch, programs, scheduler, sparse
from .constants import FIXED_OVERHEAD_BLOCKS, BLOCK_N, SCHED_META_INTS
from .params import MetadataParams
from .plan import CallPlan, LaunchPlan, MLAWorkspace, layout_key

__all__ = ["get_mla_metadata", "flash_mla_with_kvcache", "get_mla_workspace", "metadata_shapes", "MLAWorkspace"]


def _schedule_shape(batch: int, num_heads_per_head_k: int, num_heads_k: int, num_heads_q, topk):
    """(requests, query rows per request, kv heads) as the kernels see them: sparse decoding
    (``topk`` given) makes every query token a request of its own with h_q rows."""
    if topk is None:
        return batch, num_heads_per_head_k, num_heads_k
    topk = checks.require_int(topk, "topk", 1)
    h_q = checks.require_int(num_heads_q, "num_heads_q (needed with topk)", 1)
    if num_heads_k != 1 or num_heads_per_head_k % h_q:
        raise ValueError(f"sparse decoding (topk given) needs num_heads_k = 1 and num_heads_per_head_k = "
                         f"s_q * h_q, a multiple of num_heads_q = {h_q}; got {num_heads_per_head_k}, {num_heads_k}")
    return batch * (num_heads_per_head_k // h_q), h_q, 1


def metadata_shapes(batch: int, num_heads_per_head_k: int, num_heads_k: int, num_heads_q=None,
                    topk=None) -> tuple[tuple, tuple]:
    """Shapes of ``get_mla_metadata``'s two int32 outputs on CuPy's current device:
    ``((num_sm_parts, 8), (requests + 1,))`` (for preallocated ``out=`` buffers); requests is
    batch, or batch * s_q with ``topk`` (sparse decoding)."""
    requests, rows, h_kv = _schedule_shape(batch, num_heads_per_head_k, num_heads_k, num_heads_q, topk)
    props = checks.require_hopper(cupy.cuda.runtime.getDevice())
    parts = scheduler.num_sm_parts(props["sm_count"], rows, h_kv)
    return (parts, SCHED_META_INTS), (requests + 1,)


def get_mla_metadata(cache_seqlens, num_heads_per_head_k: int, num_heads_k: int, num_heads_q=None,
                     is_fp8_kvcache: bool = False, topk=None, *, out=None, stream=None):
    """Tile-scheduler metadata for one batch of decoding requests.

    Args:
        cache_seqlens: int32 ``[batch]`` on the GPU, tokens in each request's KV cache (with
            ``topk``, only its length is used).
        num_heads_per_head_k: query rows per KV head, ``s_q * h_q // h_kv``.
        num_heads_k: KV heads ``h_kv`` (1 for DeepSeek's MLA).
        num_heads_q, is_fp8_kvcache, topk: sparse decoding (DeepSeek-V3.2, FlashMLA's
            interface): ``topk`` = indices' last dim, every query token is scheduled as a
            request of ``topk`` tokens; ``num_heads_q`` = h_q is then required.
        out: optional preallocated ``(tile_scheduler_metadata, num_splits)`` (shapes from
            ``metadata_shapes``); given, they are written and returned.
        stream: where to run (default: CuPy's current stream); see ``flash_mla_with_kvcache``.

    Returns:
        ``(tile_scheduler_metadata, num_splits)``: int32 ``[num_sm_parts, 8]`` — per SM part,
        the (request, token) range it processes — and int32 ``[batch + 1]``, prefix sums of each
        request's number of splits. Compute it once per batch and pass it to every
        ``flash_mla_with_kvcache`` call (every layer) of that batch.
    """
    stream_ptr = interop.stream_handle(stream)
    seqlens, heads_per_kv, h_kv, props = checks.metadata_inputs(cache_seqlens, num_heads_per_head_k, num_heads_k)
    batch, heads_per_kv, h_kv = _schedule_shape(seqlens.shape[0], heads_per_kv, h_kv, num_heads_q, topk)
    device_id = cupy.cuda.runtime.getDevice()
    record = errors.record(device_id)
    errors.raise_pending(record)
    if stream is None and type(cache_seqlens) is interop.torch_tensor_type():
        interop.wait_for_torch(device_id, stream_ptr)
    parts = scheduler.num_sm_parts(props["sm_count"], heads_per_kv, h_kv)
    if out is None:
        with interop.on_stream(stream_ptr):          # the pool ties memory to its stream
            metadata = cupy.empty((parts, SCHED_META_INTS), dtype=np.int32)
            num_splits = cupy.empty((batch + 1,), dtype=np.int32)
        result = (metadata, num_splits)
    else:
        metadata, num_splits = checks.metadata_outputs(out, batch, parts)
        result = tuple(out)
    run = _metadata_launch(device_id, stream_ptr)
    p = run.params
    p.seqlens, p.sched_meta, p.num_splits = seqlens.data.ptr, metadata.data.ptr, num_splits.data.ptr
    p.error, p.batch, p.num_sm_parts = errors.kernel_pointer(record), batch, parts
    p.uniform_seqlen = -1 if topk is None else topk
    run()
    errors.after_launch(record, stream_ptr)
    return result


_metadata_launches: dict[tuple[int, int], launch.Launch] = {}


def _metadata_launch(device_id: int, stream_ptr: int) -> launch.Launch:
    run = _metadata_launches.get((device_id, stream_ptr))
    if run is None:
        run = launch.get_kernel(programs.metadata_program()).prepare((1, 1, 1), (32, 1, 1), MetadataParams,
                                                                     stream=stream_ptr)
        run.params.block_n, run.params.fixed_overhead_blocks = BLOCK_N, FIXED_OVERHEAD_BLOCKS
        if len(_metadata_launches) >= _MAX_PLANS:
            _metadata_launches.clear()
        _metadata_launches[(device_id, stream_ptr)] = run
    return run


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v: int,
                           tile_scheduler_metadata, num_splits, softmax_scale: float | None = None,
                           causal: bool = False, is_fp8_kvcache: bool = False, indices=None, attn_sink=None,
                           topk_length=None, *, k_scale=None, q_scale=None, out=None, lse=None, workspace=None,
                           stream=None):
    """Paged MLA decoding attention (FlashMLA's interface) on CuPy arrays or torch tensors.

    Args:
        q: ``[batch, s_q, h_q, 576]``, ``ml_dtypes.bfloat16`` or ``float16``; s_q > 1 for MTP /
            speculative decoding.
        k_cache: ``[num_blocks, page_block_size, h_kv, 576]``, q's dtype; pages of any
            power-of-two size (FlashMLA: 64 only). V is its first 512 columns (K and V share the
            latent).
        block_table: int32 ``[batch, max_blocks_per_seq]``, page ids of each request in order.
        cache_seqlens: int32 ``[batch]``, tokens per request (0 allowed).
        head_dim_v: 512.
        tile_scheduler_metadata, num_splits: from ``get_mla_metadata(cache_seqlens,
            s_q * h_q // h_kv, h_kv)`` of this batch.
        softmax_scale: default ``576 ** -0.5``.
        causal: with s_q > 1, query token i sees the first ``seqlen - (s_q - 1 - i)`` tokens.
        out, lse: optional preallocated outputs (C-contiguous, shapes and dtypes as returned);
            given, the results are written there and the same objects are returned.
        workspace: optional ``get_mla_workspace(...)`` for this batch shape (default: one kept
            per call layout and stream). With ``out`` and ``lse`` the call allocates nothing.
        stream: a ``cupy.cuda.Stream``, a raw ``cudaStream_t``, or an object with
            ``cuda_stream`` / ``__cuda_stream__`` (torch streams); default CuPy's current
            stream. Inputs must be ready on it.

    The FP8 cache (``is_fp8_kvcache=True``, no ``indices``; vLLM's per-tensor convention):
        k_cache: ``[num_blocks, page_block_size, 1, 576]`` float8_e4m3 values (uint8 / int8 /
            float8_e4m3fn), token rows contiguous; K = V = value * k_scale
            (``quant.quantize_fp8_per_tensor`` builds it); pages of any power-of-two size.
        k_scale: float32 GPU array of one element (shape () or (1,)), read by the kernel (so it
            may change between calls, and CUDA graphs replay its current value).
        q: bf16, or float8_e4m3 values (uint8 / int8 / float8_e4m3fn) with ``q_scale``; out bf16.
            Inside, a bf16 q's Q, K, V and P are fp16 (e4m3 values are exact in it; a bf16 q is
            exact for 2^-14 <= |q| < 65504, rounded to fp16's subnormals below); an e4m3 q's QK^T
            is an FP8 WGMMA on the e4m3 values themselves, its V and P fp16
            (``quant.quantize_fp8_per_tensor`` builds an e4m3 q too).
        q_scale: float32 GPU array of one element, an e4m3 q's dequantization scale (Q = value *
            q_scale), read by the kernel like k_scale; required with an e4m3 q, refused otherwise.
            With an e4m3 q both products run in FP8: the softmax weights are rounded to e4m3 for
            P V (each within 2^-4 of itself, the cache values' own precision).

    Sparse decoding (DeepSeek-V3.2; ``indices`` given, FlashMLA's semantics):
        is_fp8_kvcache: must be True: k_cache is ``[num_blocks, page_block_size, 1, 656]`` bytes
            (uint8 / int8 / float8_e4m3fn), per token 512 e4m3 values, 4 float32 scales (one
            per 128 values), 64 bf16 RoPE values (``flashmla_cupy.quant`` builds it); any
            page_block_size; q bf16. block_table and cache_seqlens are not used.
        indices: int32 ``[batch, s_q, topk]``, ``block * page_block_size + offset`` of each token a
            query token attends; -1 or any id outside the cache is skipped (duplicates count twice).
        attn_sink: float32 ``[h_q]`` or None: out *= exp(lse) / (exp(lse) + exp(attn_sink[h])).
        topk_length: int32 ``[batch]`` or None: only the first ``topk_length[b]`` indices count
            (clamped to [0, topk]).
        Metadata from ``get_mla_metadata(cache_seqlens, s_q * h_q, 1, h_q, True, topk)``. Inside,
        Q's and the cache's NoPE parts are fp16 (exact for e4m3 values times power-of-two scales
        up to 2^7 — what ``quant`` produces for |values| < 57344 — and for |q| < 65504).

    Returns:
        ``(out, lse)``: ``[batch, s_q, h_q, 512]`` in q's dtype and float32 ``[batch, h_q, s_q]``
        (natural-log sum of exp of the scaled scores); CuPy arrays unless given. A row that
        sees no token gets out = 0 and lse = +inf; a request with a bad length or block id
        gets NaN (and the error is raised by a later call: see ``flashmla_cupy.errors``).

    q's head h attends with kv head ``h // (h_q // h_kv)``. torch tensors are read in place
    (pointer, shape and strides; without ``stream`` the call first waits for torch's current
    stream); other ``__dlpack__`` / ``__cuda_array_interface__`` arrays are viewed as CuPy
    arrays. Host work per call: one plan lookup, the arrays' addresses written into two
    prebuilt launches, two driver calls.
    """
    stream_ptr = cupy.cuda.get_current_stream().ptr if stream is None else interop.stream_handle(stream)
    device_id = cupy.cuda.runtime.getDevice()
    if indices is None:
        if attn_sink is not None or topk_length is not None:
            raise ValueError("attn_sink and topk_length are for sparse decoding (pass indices)")
        arrays = (q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits)
        fp8 = is_fp8_kvcache if is_fp8_kvcache is False or is_fp8_kvcache is True else \
            checks.require_bool(is_fp8_kvcache, "is_fp8_kvcache")
        if fp8:
            if k_scale is None:
                raise ValueError("k_scale is required with the FP8 cache (is_fp8_kvcache=True): a float32 GPU "
                                 "array of one element, the cache's dequantization scale")
            arrays, names = arrays + (k_scale, q_scale), _DENSE_FP8_ARRAYS
        elif k_scale is not None or q_scale is not None:
            raise ValueError(f"{'k_scale' if k_scale is not None else 'q_scale'} is for the dense FP8 cache: pass "
                             f"is_fp8_kvcache=True (and k_scale)")
        else:
            names = _DENSE_ARRAYS
    else:
        if k_scale is not None or q_scale is not None:
            raise ValueError(f"{'k_scale' if k_scale is not None else 'q_scale'} is for dense decoding over the FP8 "
                             f"cache; sparse decoding takes a bf16 q and its cache carries its own scales")
        arrays = (q, k_cache, indices, tile_scheduler_metadata, num_splits, topk_length, attn_sink)
        names = _SPARSE_ARRAYS
    layout = layout_key(arrays)
    from_torch = layout is not None and layout[0][0] == "torch"
    if layout is None:      # other or mixed array types: CuPy views of each, on every call
        from_torch = any(type(x) is interop.torch_tensor_type() for x in arrays)
        arrays = tuple(x if x is None and name in _OPTIONAL_ARRAYS else checks.device_view(x, name)
                       for x, name in zip(arrays, names))
        layout = layout_key(arrays)
    key = (device_id, stream_ptr, head_dim_v, type(head_dim_v), softmax_scale, type(softmax_scale),
           causal, type(causal), is_fp8_kvcache, type(is_fp8_kvcache), layout[0])
    plan = _plans.get(key)
    if plan is None:
        plan = _new_plan(key, stream_ptr, arrays, names is _SPARSE_ARRAYS, head_dim_v, softmax_scale, causal,
                         is_fp8_kvcache)
    if from_torch and stream is None:       # torch wrote the inputs on its current stream
        interop.wait_for_torch(device_id, stream_ptr)
    return plan.run(layout[1], arrays[0], out, lse, workspace)


_DENSE_ARRAYS = ("q", "k_cache", "block_table", "cache_seqlens", "tile_scheduler_metadata", "num_splits")
_DENSE_FP8_ARRAYS = _DENSE_ARRAYS + ("k_scale", "q_scale")
_SPARSE_ARRAYS = ("q", "k_cache", "indices", "tile_scheduler_metadata", "num_splits", "topk_length", "attn_sink")
_OPTIONAL_ARRAYS = ("topk_length", "attn_sink", "q_scale")


def get_mla_workspace(q, k_cache, tile_scheduler_metadata, *, sparse: bool = False, alloc=None) -> MLAWorkspace:
    """A workspace for ``flash_mla_with_kvcache`` calls with these arrays' shapes and dtype
    (``sparse``: calls with ``indices``, whose every query token is a request of its own).

    ``alloc(nbytes)`` allocates its memory (default: CuPy); it returns any CUDA array, e.g.
    ``lambda n: torch.empty(n, dtype=torch.uint8, device="cuda")``, which the workspace keeps.
    """
    q = checks.as_device_array(q, "q")
    k_cache = checks.as_device_array(k_cache, "k_cache")
    meta = checks.as_device_array(tile_scheduler_metadata, "tile_scheduler_metadata")
    checks.require_ndim(q, "q", 4, "[batch, s_q, h_q, 576]")
    checks.require_ndim(k_cache, "k_cache", 4, "[num_blocks, page_block_size, h_kv, 576]")
    checks.require_ndim(meta, "tile_scheduler_metadata", 2, "[num_sm_parts, 8]")
    batch, s_q, h_q, _ = q.shape
    if sparse:
        return MLAWorkspace(batch * s_q, 1, h_q, 1, meta.shape[0], checks.out_dtype(q.dtype), alloc=alloc)
    h_kv = k_cache.shape[2]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"k_cache's heads (axis 2) must divide q's heads ({h_q}); got {h_kv}")
    return MLAWorkspace(batch, s_q, h_q, h_kv, meta.shape[0], checks.out_dtype(q.dtype), alloc=alloc)


_MAX_PLANS = 16
_plans: OrderedDict[tuple, LaunchPlan] = OrderedDict()
_plans_lock = threading.Lock()


def _new_plan(key, stream_ptr, arrays, sparse_call, head_dim_v, softmax_scale, causal, is_fp8_kvcache) -> LaunchPlan:
    """Check every argument (the first call with a layout), then keep its plan."""
    family = "cupy" if type(arrays[0]) is cupy.ndarray else "torch"
    if not sparse_call:      # (k_scale, q_scale: the FP8 cache)
        a = checks.mla_inputs(*arrays[:4], head_dim_v, *arrays[4:6], softmax_scale, causal, *arrays[6:])
        plan = CallPlan(a, stream_ptr, family)
    else:
        q, k_cache, indices, metadata, num_splits, topk_length, attn_sink = arrays
        a = sparse.sparse_inputs(q, k_cache, head_dim_v, metadata, num_splits, softmax_scale, causal,
                                 is_fp8_kvcache, indices, attn_sink, topk_length)
        plan = sparse.SparsePlan(a, stream_ptr, family)
    with _plans_lock:
        _plans[key] = plan
        if len(_plans) > _MAX_PLANS:
            _plans.popitem(last=False)
    return plan
