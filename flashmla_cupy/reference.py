"""Float64 reference implementations of the attention computed by the kernels.

These are the ground truth of the tests and a tool for researchers: plain array code, written to
be read and trusted, that computes in float64 whatever the input precision. Every function
accepts NumPy arrays or CuPy arrays and returns arrays of the same library, so that large cases
(batch 128, 16k tokens, 128 heads) can be checked on the GPU itself.

* ``mla_decode``: paged MLA decoding (FlashMLA's ``flash_mla_with_kvcache``, on a 16-bit cache or
  a dense FP8 one with one scale per tensor): per request it gathers only the cache pages that
  hold valid tokens and does one matmul for the scores and one for the output per KV head.
* ``mla_decode_dense``: the same attention, written naively on a dense per-request cache with
  explicit loops; it exists to cross-check ``mla_decode`` in the tests.
* ``mla_decode_sparse``: DeepSeek-V3.2's sparse decoding (``flash_mla_with_kvcache`` with
  ``indices``): each query token attends to its own list of cache tokens, with an optional
  attention sink and per-request top-k lengths, on a float cache or the 656-byte FP8 one
  (``flashmla_cupy.quant``).
* ``attention``: standard (optionally causal) attention, for the minimal FlashAttention kernel.
* ``cos_diff``, ``max_abs_error``: the comparison criteria of the tests (FlashMLA's tests require
  ``cos_diff < 1e-5`` between kernel and reference).

Conventions shared with the kernels: ``lse`` is the natural-log logsumexp of the *scaled*
scores; a query row that sees no key gets ``out = 0`` and ``lse = +inf``.
"""
from __future__ import annotations

import math

import numpy as np

from . import quant


# --------------------------------------------------------------------------------------------
# Arrays: NumPy or CuPy, always computed in float64
# --------------------------------------------------------------------------------------------

def _array_module(*arrays):
    """``cupy`` if any argument is a CuPy array, else ``numpy`` (also when CuPy is missing)."""
    try:
        import cupy
    except ImportError:
        return np
    return cupy.get_array_module(*arrays)


def _to_host(x) -> np.ndarray:
    """``x`` as a NumPy array, copied from the GPU if it is a CuPy array."""
    xp = _array_module(x)
    return np.asarray(x) if xp is np else xp.asnumpy(x)


def to_float64(x):
    """``x`` as a float64 array of the same library (bfloat16, float16, float32, ints...).

    bfloat16 is widened through its bits (the upper half of a float32): exact, and independent of
    whether the array library knows how to cast ``ml_dtypes.bfloat16``.
    """
    if x.dtype.name == "bfloat16":
        bits = x.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _in_library(x, xp):
    """``x`` as an array of ``xp`` (NumPy or CuPy), copied between host and GPU if needed."""
    return _to_host(x) if xp is np else xp.asarray(x)


def _same_library(x, y):
    """``x`` and ``y`` in one array library: on the host if they are not both on the GPU."""
    if _array_module(x) is _array_module(y):
        return x, y
    return _to_host(x), _to_host(y)


# --------------------------------------------------------------------------------------------
# MLA decoding
# --------------------------------------------------------------------------------------------

def _check_mla_shapes(q, k_cache, block_table, cache_seqlens, head_dim_v):
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"q must be [b, s_q, h_q, d] and k_cache [num_blocks, page, h_kv, d]; "
                         f"got shapes {tuple(q.shape)} and {tuple(k_cache.shape)}")
    b, _, h_q, d = q.shape
    h_kv, d_k = k_cache.shape[2], k_cache.shape[3]
    if d_k != d:
        raise ValueError(f"q's and k_cache's head dims differ: {d} and {d_k}")
    if not 0 < head_dim_v <= d:
        raise ValueError(f"head_dim_v must be in [1, {d}] (V is the first head_dim_v columns of K); got {head_dim_v}")
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"q's heads ({h_q}) must be a multiple of k_cache's heads ({h_kv})")
    if block_table.ndim != 2 or block_table.shape[0] != b or tuple(cache_seqlens.shape) != (b,):
        raise ValueError(f"block_table must be [{b}, max_blocks] and cache_seqlens [{b}]; got shapes "
                         f"{tuple(block_table.shape)} and {tuple(cache_seqlens.shape)}")


def mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v: int = 512,
               softmax_scale: float | None = None, causal: bool = False, k_scale=None, q_scale=None,
               *, abs_values: bool = False):
    """Paged MLA decoding attention in float64 (what ``flash_mla_with_kvcache`` computes).

    Args:
        q: ``[b, s_q, h_q, d]`` (d = 576 for DeepSeek's MLA; any d >= head_dim_v works),
            bfloat16 (``ml_dtypes``), float16, float32 or float64; or FP8 codes (uint8, int8,
            ``ml_dtypes.float8_e4m3fn``) with ``q_scale``.
        k_cache: ``[num_blocks, page_block_size, h_kv, d]``, the paged KV cache; the page size
            is read from the shape. V is ``k_cache[..., :head_dim_v]`` (K and V share the latent).
            FP8 codes with ``k_scale``: a dense FP8 cache, one scale for the whole tensor.
        block_table: int ``[b, max_blocks]``; token j of request i lives in page
            ``block_table[i, j // page_block_size]`` at slot ``j % page_block_size``. Entries past
            a request's last page are never read.
        cache_seqlens: int ``[b]``, valid tokens per request (0 allowed). Cache slots at or past
            a request's length are never read, so they may hold anything (NaN included).
        head_dim_v: columns of V.
        softmax_scale: multiplies the scores Q K^T; default ``d ** -0.5``.
        causal: for s_q > 1 (multi-token prediction): query token i (0-based) sees the keys
            ``j < seqlen - (s_q - 1 - i)``, i.e. the last query token sees the whole sequence.
        k_scale, q_scale: the dequantization scales of an FP8 k_cache and q (required with
            them, refused without): values are ``fp8 * scale``, exactly in float64
            (``quant.quantize_fp8_per_tensor``).
        abs_values: the same weights applied to |V| instead of V: ``sum_j p_j |v_j| / sum_j p_j``,
            the scale of an error made relative to each weight (the tests' bound for P rounded
            to e4m3).

    Returns:
        ``(out, lse)`` in float64: ``[b, s_q, h_q, head_dim_v]`` and ``[b, h_q, s_q]`` (natural-log
        logsumexp of the scaled scores). Query head h attends with KV head ``h // (h_q // h_kv)``.
        A row that sees no key (seqlen 0, or causal with seqlen < s_q) gets out = 0, lse = +inf.
        Arrays of q's library: q and k_cache are both NumPy or both CuPy arrays; block_table and
        cache_seqlens may be either (they are read on the host).
    """
    _check_mla_shapes(q, k_cache, block_table, cache_seqlens, head_dim_v)
    q_scale = _fp8_scale(q, q_scale, "q", "q_scale")
    k_scale = _fp8_scale(k_cache, k_scale, "k_cache", "k_scale")
    xp = _array_module(q)
    if _array_module(k_cache) is not xp:
        raise TypeError("q and k_cache must both be NumPy arrays or both be CuPy arrays")
    b, s_q, h_q, d = q.shape
    page_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    heads_per_kv = h_q // h_kv
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    seqlens = _to_host(cache_seqlens).astype(np.int64)
    table = _to_host(block_table)
    if (seqlens < 0).any() or (seqlens > table.shape[1] * page_size).any():
        raise ValueError(f"cache_seqlens must lie in [0, {table.shape[1] * page_size}] "
                         f"(block_table columns x page size); got {seqlens.tolist()}")

    q64 = _dequantized(q, q_scale)
    out = xp.zeros((b, s_q, h_q, head_dim_v), dtype=np.float64)
    lse = xp.full((b, h_q, s_q), np.inf, dtype=np.float64)
    for i in range(b):
        seqlen = int(seqlens[i])
        if seqlen == 0:
            continue
        pages = table[i, :-(-seqlen // page_size)]
        # Only this request's pages, cut to its length before the cast: NaN in unused slots
        # never enters the arithmetic.
        keys = k_cache[xp.asarray(pages)].reshape(-1, h_kv, d)[:seqlen]
        keys = _dequantized(keys, k_scale)                                # [seqlen, h_kv, d]
        # Query rows are (token, head-in-group) pairs, token-major; their visible key counts:
        visible = seqlen - (s_q - 1 - np.arange(s_q)) if causal else np.full(s_q, seqlen)
        hidden = xp.arange(seqlen)[None, :] >= xp.asarray(np.repeat(visible, heads_per_kv))[:, None]
        for g in range(h_kv):
            heads = slice(g * heads_per_kv, (g + 1) * heads_per_kv)
            rows = q64[i, :, heads, :].reshape(s_q * heads_per_kv, d)
            k = keys[:, g, :]
            scores = xp.where(hidden, -np.inf, (rows @ k.T) * scale)     # [rows, seqlen]
            row_max = scores.max(axis=1)
            # A fully hidden row has max -inf: shift it by 0 instead, so its exps are all 0.
            shift = xp.where(xp.isfinite(row_max), row_max, 0.0)
            weights = xp.exp(scores - shift[:, None])
            sums = weights.sum(axis=1)
            empty = sums == 0
            sums = xp.where(empty, 1.0, sums)
            v = xp.abs(k[:, :head_dim_v]) if abs_values else k[:, :head_dim_v]
            o = (weights @ v) / sums[:, None]                              # empty rows: 0 / 1
            row_lse = xp.where(empty, np.inf, xp.log(sums) + shift)
            out[i, :, heads, :] = o.reshape(s_q, heads_per_kv, head_dim_v)
            lse[i, heads, :] = row_lse.reshape(s_q, heads_per_kv).T
    return out, lse


def _fp8_scale(x, scale, name: str, scale_name: str):
    """The scale of an FP8 ``x`` (codes: a byte dtype) as a float, or None for a float ``x``."""
    fp8 = x.dtype.name in quant.BYTE_DTYPES
    if fp8 and scale is None:
        raise ValueError(f"{name} holds FP8 codes ({x.dtype}): {scale_name} is required")
    if not fp8 and scale is not None:
        raise ValueError(f"{scale_name} is only for an FP8 {name} (a byte dtype); {name} is {x.dtype}")
    return None if scale is None else float(_to_host(scale).reshape(()))


def _dequantized(x, scale):
    """``x`` in float64: FP8 codes times their scale, or the floats as they are."""
    return to_float64(x) if scale is None else quant.dequantize_fp8_per_tensor(x, scale, np.float64)


def mla_decode_dense(q, k, seqlens, head_dim_v: int = 512, softmax_scale: float | None = None,
                     causal: bool = False):
    """MLA decoding written as naively as possible, on NumPy arrays, to cross-check ``mla_decode``.

    Args:
        q: ``[b, s_q, h_q, d]``, any float dtype.
        k: ``[b, max_seqlen, h_kv, d]``, each request's keys in order (no pages); V is
            ``k[..., :head_dim_v]``. Tokens at or past a request's length are never read.
        seqlens: int ``[b]``.
        head_dim_v, softmax_scale, causal: as in ``mla_decode``.

    Returns:
        ``(out, lse)`` float64 ``[b, s_q, h_q, head_dim_v]`` and ``[b, h_q, s_q]``, as ``mla_decode``.

    One (request, query token, head) at a time: select the visible keys, logsumexp, then weights
    ``exp(score - lse)`` -- a different route to the same numbers than ``mla_decode`` takes.
    """
    q, k = to_float64(np.asarray(q)), to_float64(np.asarray(k))
    b, s_q, h_q, d = q.shape
    heads_per_kv = h_q // k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    out = np.zeros((b, s_q, h_q, head_dim_v))
    lse = np.full((b, h_q, s_q), np.inf)
    for i in range(b):
        for t in range(s_q):
            visible = int(seqlens[i]) - (s_q - 1 - t) if causal else int(seqlens[i])
            if visible <= 0:
                continue
            for h in range(h_q):
                keys = k[i, :visible, h // heads_per_kv, :]
                scores = keys @ q[i, t, h] * scale
                m = scores.max()
                lse[i, h, t] = m + math.log(np.exp(scores - m).sum())
                out[i, t, h] = np.exp(scores - lse[i, h, t]) @ keys[:, :head_dim_v]
    return out, lse


# --------------------------------------------------------------------------------------------
# Sparse MLA decoding (DeepSeek-V3.2)
# --------------------------------------------------------------------------------------------

def _is_fp8_cache(k_cache) -> bool:
    """The rule for ``k_cache``: bytes (uint8, int8, float8_e4m3fn) are the 656-byte FP8 layout."""
    return k_cache.dtype.name in quant.BYTE_DTYPES


def _check_sparse_arguments(q, k_cache, indices, attn_sink, topk_length, head_dim_v):
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"q must be [b, s_q, h_q, d] and k_cache [num_blocks, page_block_size, 1, d]; "
                         f"got shapes {tuple(q.shape)} and {tuple(k_cache.shape)}")
    b, s_q, h_q, d = q.shape
    if k_cache.shape[2] != 1:
        raise ValueError(f"k_cache must have one KV head (sparse decoding shares the indices across "
                         f"heads); got shape {tuple(k_cache.shape)}")
    if _is_fp8_cache(k_cache):
        if k_cache.shape[3] != quant.FP8_TOKEN_BYTES or d != quant.HEAD_DIM_K:
            raise ValueError(f"an FP8 k_cache ({k_cache.dtype}) must be [num_blocks, page_block_size, 1, "
                             f"{quant.FP8_TOKEN_BYTES}] and q [b, s_q, h_q, {quant.HEAD_DIM_K}]; got shapes "
                             f"{tuple(k_cache.shape)} and {tuple(q.shape)}")
    elif k_cache.shape[3] != d:
        raise ValueError(f"q's and k_cache's head dims differ: {d} and {k_cache.shape[3]}")
    if not 0 < head_dim_v <= d:
        raise ValueError(f"head_dim_v must be in [1, {d}] (V is the first head_dim_v columns of K); got {head_dim_v}")
    if indices.ndim != 3 or tuple(indices.shape[:2]) != (b, s_q):
        raise ValueError(f"indices must be [{b}, {s_q}, topk]; got shape {tuple(indices.shape)}")
    if indices.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers (int32); got {indices.dtype}")
    if topk_length is not None:
        if tuple(topk_length.shape) != (b,):
            raise ValueError(f"topk_length must be [{b}]; got shape {tuple(topk_length.shape)}")
        if topk_length.dtype.kind not in "iu":
            raise TypeError(f"topk_length must be integers (int32); got {topk_length.dtype}")
    if attn_sink is not None and tuple(attn_sink.shape) != (h_q,):
        raise ValueError(f"attn_sink must be [{h_q}] (one value per query head); got shape {tuple(attn_sink.shape)}")


def mla_decode_sparse(q, k_cache, indices, softmax_scale: float | None = None, attn_sink=None,
                      topk_length=None, head_dim_v: int = 512):
    """Sparse MLA decoding in float64 (``flash_mla_with_kvcache`` with ``indices``: DeepSeek-V3.2).

    Args:
        q: ``[b, s_q, h_q, d]``, any float dtype (``ml_dtypes.bfloat16`` included); d = 576 for
            DeepSeek (and the FP8 cache), any d >= head_dim_v with a float cache.
        k_cache: the paged cache, one KV head, either floats ``[num_blocks, page_block_size, 1, d]``
            or DeepSeek-V3.2's FP8 cache: **a byte dtype (uint8, int8, float8_e4m3fn) means the
            656-byte layout** ``[num_blocks, page_block_size, 1, 656]`` (``flashmla_cupy.quant``),
            which is dequantized exactly to float64. V is the first head_dim_v columns of K.
        indices: int ``[b, s_q, topk]``: the cache tokens that query token j of request i attends
            to, each ``block * page_block_size + offset`` (a row of the cache with its first two
            axes flattened). An index < 0 (-1 pads) or >= ``num_blocks * page_block_size`` is
            skipped; an index given twice counts twice.
        softmax_scale: multiplies the scores Q K^T; default ``d ** -0.5``.
        attn_sink: float ``[h_q]``, optional: head h's output is multiplied by
            ``exp(lse) / (exp(lse) + exp(attn_sink[h]))``; lse is left as it is. -inf changes
            nothing, +inf makes the output 0.
        topk_length: int ``[b]``, optional: request i uses only ``indices[i, :, :topk_length[i]]``
            (clamped to ``[0, topk]``); the indices after them are never read.
        head_dim_v: columns of V.

    Returns:
        ``(out, lse)`` in float64: ``[b, s_q, h_q, head_dim_v]`` and ``[b, h_q, s_q]`` (natural-log
        logsumexp of the scaled scores). A query token with no index left gets out = 0,
        lse = +inf. Arrays of q's library: q and k_cache are both NumPy or both CuPy arrays;
        indices, attn_sink and topk_length may be either. Cache rows that no used index points to
        are never read into the arithmetic (they may hold NaN).
    """
    xp = _array_module(q)
    if _array_module(k_cache) is not xp:
        raise TypeError("q and k_cache must both be NumPy arrays or both be CuPy arrays")
    indices = _in_library(indices, xp)
    attn_sink = None if attn_sink is None else _in_library(attn_sink, xp)
    topk_length = None if topk_length is None else _to_host(topk_length)
    _check_sparse_arguments(q, k_cache, indices, attn_sink, topk_length, head_dim_v)
    b, s_q, h_q, d = q.shape
    topk = indices.shape[2]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    lengths = np.full(b, topk) if topk_length is None else np.clip(topk_length.astype(np.int64), 0, topk)
    tokens = k_cache.reshape(-1, k_cache.shape[3])            # row = block * page_block_size + offset
    sink = None if attn_sink is None else to_float64(attn_sink)

    q64 = to_float64(q)
    out = xp.zeros((b, s_q, h_q, head_dim_v), dtype=np.float64)
    lse = xp.full((b, h_q, s_q), np.inf, dtype=np.float64)
    for i in range(b):
        idx = indices[i, :, :int(lengths[i])].astype(np.int64)              # [s_q, n]
        valid = (idx >= 0) & (idx < tokens.shape[0])
        if not bool(valid.any()):
            continue
        # Skipped slots gather token 0 and are zeroed before any arithmetic: no NaN gets in.
        rows = tokens[xp.where(valid, idx, 0)]                               # [s_q, n, d or 656]
        keys = quant.dequantize_fp8_sparse(rows, np.float64) if _is_fp8_cache(k_cache) else to_float64(rows)
        keys = xp.where(valid[..., None], keys, 0.0)
        scores = xp.where(valid[:, None, :], (q64[i] @ keys.swapaxes(1, 2)) * scale, -np.inf)  # [s_q, h_q, n]
        row_max = scores.max(axis=2)
        # A row with no valid index has max -inf: shift it by 0 instead, so its exps are all 0.
        shift = xp.where(xp.isfinite(row_max), row_max, 0.0)
        weights = xp.exp(scores - shift[..., None])
        sums = weights.sum(axis=2)
        empty = sums == 0
        sums = xp.where(empty, 1.0, sums)
        o = (weights @ keys[..., :head_dim_v]) / sums[..., None]             # empty rows: 0 / 1
        row_lse = xp.where(empty, np.inf, xp.log(sums) + shift)             # [s_q, h_q]
        if sink is not None:
            # exp(lse) / (exp(lse) + exp(sink)) as exp(lse - logaddexp(lse, sink)): no overflow,
            # exactly 1 for sink = -inf, 0 for +inf. Empty rows (lse 0 here) stay 0.
            live_lse = xp.where(empty, 0.0, row_lse)
            o *= xp.exp(live_lse - xp.logaddexp(live_lse, sink))[..., None]
        out[i] = o
        lse[i] = row_lse.T
    return out, lse


# --------------------------------------------------------------------------------------------
# Standard attention
# --------------------------------------------------------------------------------------------

def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """Standard softmax attention in float64.

    Args:
        q, k: ``[B, H, N, d]``; v: ``[B, H, N, dv]`` (same sequence length N for all three).
        causal: query i sees keys ``j <= i`` (lower-triangular mask).
        softmax_scale: default ``d ** -0.5``.

    Returns:
        ``(out, lse)`` float64 ``[B, H, N, dv]`` and ``[B, H, N]`` (natural-log logsumexp of the
        scaled scores), arrays of q's library (NumPy or CuPy).
    """
    if q.ndim != 4 or q.shape != k.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q and k must be [B, H, N, d] and v [B, H, N, dv]; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    xp = _array_module(q, k, v)
    n, d = q.shape[2], q.shape[3]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    # In place from here on: the N x N scores dominate the memory of long sequences.
    scores = to_float64(q) @ to_float64(k).swapaxes(-1, -2)             # [B, H, N, N]
    scores *= scale
    if causal:
        scores += xp.where(xp.tri(n, dtype=bool), 0.0, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)   # finite: every row sees at least one key
    scores -= row_max
    weights = xp.exp(scores, out=scores)
    sums = weights.sum(axis=-1, keepdims=True)
    out = (weights @ to_float64(v)) / sums
    return out, (xp.log(sums) + row_max)[..., 0]


# --------------------------------------------------------------------------------------------
# Comparison criteria
# --------------------------------------------------------------------------------------------

def _comparable(x, y):
    """float64 copies of x and y in one library, the positions to compare, and whether a
    non-finite value breaks the comparison.

    Positions where both hold the same infinity (lse = +inf of rows that see no key) agree
    exactly and are left out. Any other non-finite value -- NaN anywhere, an infinity on one
    side only, opposite infinities -- is a mismatch.
    """
    if tuple(x.shape) != tuple(y.shape):
        raise ValueError(f"shapes differ: {tuple(x.shape)} and {tuple(y.shape)}")
    x, y = _same_library(to_float64(x), to_float64(y))
    xp = _array_module(x, y)
    same_inf = xp.isinf(x) & (x == y)
    compared = ~same_inf
    mismatch = bool((~xp.isfinite(x[compared]) | ~xp.isfinite(y[compared])).any())
    return x[compared], y[compared], mismatch


# cos_diff limits (out, lse) of the tests and of the profiler's --check: FlashMLA's 1e-5, but with
# an e4m3 q ("fp8q"), whose P V rounds each softmax weight to e4m3: the squared relative error of
# a weight averages about 2^-8 / 3 (about 6.5e-4 over many rows), so out's limit is 2^-8, the
# worst case; for lse, d^2 / (lse^2 + ref^2) of a row whose |lse| is below ~1 exceeds 1e-5 with
# the FP8 QK^T's absolute score error d, which a one-token request gives at random: lse is held
# by the tests' element bound alone (None).
COS_DIFF_LIMITS = {"fp8q": (2.0 ** -8, None)}
COS_DIFF_LIMITS_DEFAULT = (1e-5, 1e-5)


def cos_diff(x, y) -> float:
    """FlashMLA's test criterion: ``1 - 2 sum(x y) / max(sum(x^2 + y^2), 1e-12)`` in float64.

    0 for identical tensors, about 1 for unrelated ones (2 for opposite ones); the tests require
    < 1e-5. Positions where x and y hold the same infinity are excluded (they agree exactly); any
    other non-finite value makes the result ``inf``, so a threshold check fails. Two tensors that
    are all zeros (after that exclusion) give 0, where the bare formula would give 1.
    """
    x, y, mismatch = _comparable(x, y)
    if mismatch:
        return math.inf
    energy = float((x * x + y * y).sum())
    if energy == 0.0:
        return 0.0
    return 1.0 - 2.0 * float((x * y).sum()) / max(energy, 1e-12)


def max_abs_error(x, y) -> float:
    """``max |x - y|`` in float64, with the infinity rules of ``cos_diff`` (0 if nothing is left)."""
    x, y, mismatch = _comparable(x, y)
    if mismatch:
        return math.inf
    return float(abs(x - y).max()) if x.size else 0.0
