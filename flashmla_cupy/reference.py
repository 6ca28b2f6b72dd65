"""Float64 reference implementations of the attention computed by the kernels.

These are the ground truth of the tests and a tool for researchers: plain array code, written to
be read and trusted, that computes in float64 whatever the input precision. Every function
accepts NumPy arrays or CuPy arrays and returns arrays of the same library, so that large cases
(batch 128, 16k tokens, 128 heads) can be checked on the GPU itself.

* ``mla_decode``: paged MLA decoding (FlashMLA's ``flash_mla_with_kvcache``): per request it
  gathers only the cache pages that hold valid tokens and does one matmul for the scores and one
  for the output per KV head.
* ``mla_decode_dense``: the same attention, written naively on a dense per-request cache with
  explicit loops; it exists to cross-check ``mla_decode`` in the tests.
* ``attention``: standard (optionally causal) attention, for the minimal FlashAttention kernel.
* ``cos_diff``, ``max_abs_error``: the comparison criteria of the tests (FlashMLA's tests require
  ``cos_diff < 1e-5`` between kernel and reference).

Conventions shared with the kernels: ``lse`` is the natural-log logsumexp of the *scaled*
scores; a query row that sees no key gets ``out = 0`` and ``lse = +inf``.
"""
from __future__ import annotations

import math

import numpy as np


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
               softmax_scale: float | None = None, causal: bool = False):
    """Paged MLA decoding attention in float64 (what ``flash_mla_with_kvcache`` computes).

    Args:
        q: ``[b, s_q, h_q, d]`` (d = 576 for DeepSeek's MLA; any d >= head_dim_v works),
            bfloat16 (``ml_dtypes``), float16, float32 or float64.
        k_cache: ``[num_blocks, page_block_size, h_kv, d]``, the paged KV cache; the page size
            is read from the shape. V is ``k_cache[..., :head_dim_v]`` (K and V share the latent).
        block_table: int ``[b, max_blocks]``; token j of request i lives in page
            ``block_table[i, j // page_block_size]`` at slot ``j % page_block_size``. Entries past
            a request's last page are never read.
        cache_seqlens: int ``[b]``, valid tokens per request (0 allowed). Cache slots at or past
            a request's length are never read, so they may hold anything (NaN included).
        head_dim_v: columns of V.
        softmax_scale: multiplies the scores Q K^T; default ``d ** -0.5``.
        causal: for s_q > 1 (multi-token prediction): query token i (0-based) sees the keys
            ``j < seqlen - (s_q - 1 - i)``, i.e. the last query token sees the whole sequence.

    Returns:
        ``(out, lse)`` in float64: ``[b, s_q, h_q, head_dim_v]`` and ``[b, h_q, s_q]`` (natural-log
        logsumexp of the scaled scores). Query head h attends with KV head ``h // (h_q // h_kv)``.
        A row that sees no key (seqlen 0, or causal with seqlen < s_q) gets out = 0, lse = +inf.
        Arrays of q's library: q and k_cache are both NumPy or both CuPy arrays; block_table and
        cache_seqlens may be either (they are read on the host).
    """
    _check_mla_shapes(q, k_cache, block_table, cache_seqlens, head_dim_v)
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

    q64 = to_float64(q)
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
        keys = to_float64(keys)                                           # [seqlen, h_kv, d]
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
            o = (weights @ k[:, :head_dim_v]) / sums[:, None]            # empty rows: 0 / 1
            row_lse = xp.where(empty, np.inf, xp.log(sums) + shift)
            out[i, :, heads, :] = o.reshape(s_q, heads_per_kv, head_dim_v)
            lse[i, heads, :] = row_lse.reshape(s_q, heads_per_kv).T
    return out, lse


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
