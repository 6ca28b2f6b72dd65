"""A plain CuPy implementation of paged MLA decoding: the seed benchmark's "torch" target.

Gather each request's pages through the block table, upcast, ``Q·Kᵀ`` as one batched matmul per
chunk of requests, mask (cache length, causal), softmax with its log-sum-exp, ``P·V``. No custom
kernel: this is what a framework user writes first, and what FlashMLA's speed-up is measured
against (``flashmla-cupy profile --baseline cupy``).

Semantics match ``flash_mla_with_kvcache``: q ``[b, s_q, h_q, d]``, k_cache
``[num_blocks, page, h_kv, d]`` whose first ``head_dim_v`` channels are V, block_table int32
``[b, max_blocks]``, cache_seqlens int32 ``[b]`` (each at least 1, and at least ``s_q`` when causal);
returns out ``[b, s_q, h_q, head_dim_v]`` in q's dtype and lse float32 ``[b, h_q, s_q]`` (natural log).
Query head ``h`` reads KV head ``h // (h_q // h_kv)``; with ``causal`` the query row ``i`` of
``s_q`` sees the first ``seqlen - s_q + i + 1`` keys. Cache slots past a request's length are never
read into the result (they may hold NaN, as in the seed's test).

Works on NumPy arrays too (``cupy.get_array_module``), which is how the CPU tests check it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEFAULT_WORKSPACE_BYTES = 4 << 30


def _xp(a):
    try:
        import cupy
        return cupy.get_array_module(a)
    except ImportError:
        return np


def is_bfloat16(dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def bfloat16_dtype():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def to_compute(x, dtype=np.float32):
    """Upcast bf16 (exactly, through its bits), fp16 or anything else to ``dtype``."""
    xp = _xp(x)
    if is_bfloat16(x.dtype):
        bits = xp.ascontiguousarray(x).view(xp.uint16).astype(xp.uint32) << 16
        f32 = bits.view(xp.float32)
        return f32 if np.dtype(dtype) == np.float32 else f32.astype(dtype)
    return x.astype(dtype, copy=False)


def from_float32(x, dtype):
    """Downcast float32 to ``dtype``; bf16 rounds to nearest even through the bits."""
    xp = _xp(x)
    if is_bfloat16(dtype):
        u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        # NaN stays NaN (a quiet NaN's high half), whatever the rounding did to its payload
        rounded = xp.where(xp.isnan(x), 0x7FC0, rounded)
        return rounded.astype(xp.uint16).view(bfloat16_dtype())
    return x.astype(dtype)


def _gather(k_cache, pages):
    """``k_cache[pages]``; bf16 gathered as its 16-bit patterns (no bf16 indexing kernel needed)."""
    if is_bfloat16(k_cache.dtype):
        xp = _xp(k_cache)
        return k_cache.view(xp.uint16)[pages].view(k_cache.dtype)
    return k_cache[pages]


@dataclass(frozen=True)
class _Chunk:
    begin: int
    end: int
    num_pages: int          # pages gathered per request in this chunk (the chunk's longest)


class PagedMLA:
    """Paged MLA decoding for one batch layout; call with ``(q, k_cache)``.

    Built once per (block table, cache lengths): reads the lengths to the host (one sync), splits
    the batch into chunks whose temporaries fit in ``workspace_bytes``, and precomputes the masks,
    so a call enqueues device work only.
    """

    def __init__(self, block_table, cache_seqlens, *, s_q: int, h_q: int, h_kv: int,
                 page_block: int, d: int = 576, head_dim_v: int = 512, softmax_scale: float | None = None,
                 causal: bool = False, compute_dtype=np.float32, out_dtype=None,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES):
        xp = _xp(block_table)
        self.xp = xp
        if h_q % h_kv:
            raise ValueError(f"h_q={h_q} is not a multiple of h_kv={h_kv}")
        self.block_table = block_table
        self.s_q, self.h_q, self.h_kv, self.d, self.dv = s_q, h_q, h_kv, d, head_dim_v
        self.page_block = page_block
        self.heads_per_kv = h_q // h_kv
        self.rows = s_q * self.heads_per_kv
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        self.causal = causal
        self.compute_dtype = np.dtype(compute_dtype)
        self.out_dtype = out_dtype
        seqlens = np.asarray(cache_seqlens.get() if hasattr(cache_seqlens, "get") else cache_seqlens,
                             dtype=np.int64)
        if seqlens.size and seqlens.min() < 1:
            raise ValueError("every cache length must be at least 1")
        if causal and seqlens.size and seqlens.min() < s_q:
            raise ValueError(f"causal decoding needs every cache length >= s_q={s_q}")
        self.batch = int(seqlens.size)
        self.chunks = self._plan(seqlens, workspace_bytes)
        # Per chunk: how many keys each query row may see (cache length, less the causal offset).
        j = np.arange(self.rows) // self.heads_per_kv                       # row -> query index
        offset = (s_q - 1 - j) if causal else np.zeros_like(j)
        self._limits = []      # [bc, 1, rows, 1]: keys visible to each query row
        self._lengths = []     # [bc, 1, 1, 1]: cache length of each request
        self._own_pages = []   # [bc, pages]: block-table columns that hold the request's pages
        for c in self.chunks:
            bc = c.end - c.begin
            lens = seqlens[c.begin:c.end]
            lim = lens[:, None] - offset[None, :]                             # [bc, rows]
            self._limits.append(xp.asarray(lim.reshape(bc, 1, self.rows, 1)))
            self._lengths.append(xp.asarray(lens.reshape(bc, 1, 1, 1)))
            own = np.arange(c.num_pages)[None, :] < -(-lens[:, None] // page_block)
            self._own_pages.append(xp.asarray(own))
        self._positions = {}

    def _plan(self, seqlens: np.ndarray, workspace_bytes: int) -> list[_Chunk]:
        cs = self.compute_dtype.itemsize
        chunks, begin = [], 0
        while begin < self.batch:
            end, pages = begin, 0
            while end < self.batch:
                p = max(pages, -(-int(seqlens[end]) // self.page_block))
                keys = p * self.page_block
                # gathered cache (stored + compute dtype) + scores/probabilities, per request
                per_req = keys * self.h_kv * self.d * (2 + cs) + 2 * self.h_kv * self.rows * keys * cs
                if end > begin and (end + 1 - begin) * per_req > workspace_bytes:
                    break
                pages, end = p, end + 1
            chunks.append(_Chunk(begin, end, pages))
            begin = end
        return chunks

    def _pos(self, keys: int):
        p = self._positions.get(keys)
        if p is None:
            p = self._positions[keys] = self.xp.arange(keys, dtype=np.int64)
        return p

    def __call__(self, q, k_cache):
        xp = self.xp
        b, s_q, h_q, d = q.shape
        if (b, s_q, h_q, d) != (self.batch, self.s_q, self.h_q, self.d):
            raise ValueError(f"q has shape {q.shape}, the plan was made for "
                             f"{(self.batch, self.s_q, self.h_q, self.d)}")
        exact = self.compute_dtype.itemsize >= 8
        out_dtype = self.out_dtype or (self.compute_dtype if exact else q.dtype)
        out = xp.empty((b, s_q, h_q, self.dv), dtype=out_dtype)
        lse = xp.empty((b, h_q, s_q), dtype=self.compute_dtype if exact else np.float32)
        for c, limit, length, own in zip(self.chunks, self._limits, self._lengths, self._own_pages):
            o, l = self._chunk(q, k_cache, c, limit, length, own)
            if is_bfloat16(out_dtype):
                out.view(xp.uint16)[c.begin:c.end] = from_float32(o, out_dtype).view(xp.uint16)
            else:
                out[c.begin:c.end] = o
            lse[c.begin:c.end] = l
        return out, lse

    def _chunk(self, q, k_cache, c: _Chunk, limit, length, own):
        xp, cd = self.xp, self.compute_dtype
        bc, h_kv, rows, d = c.end - c.begin, self.h_kv, self.rows, self.d
        keys = c.num_pages * self.page_block
        qc = to_compute(q[c.begin:c.end], cd)                                  # [bc, s_q, h_q, d]
        qc = qc.reshape(bc, self.s_q, h_kv, self.heads_per_kv, d).transpose(0, 2, 1, 3, 4)
        qc = qc.reshape(bc, h_kv, rows, d)                                    # row = (query, head)
        # Columns past a request's own pages may hold anything: gather page 0 there (masked below).
        pages = xp.where(own, self.block_table[c.begin:c.end, :c.num_pages], 0)
        kv = to_compute(_gather(k_cache, pages), cd)                          # [bc, pages, blk, h_kv, d]
        kv = kv.reshape(bc, keys, h_kv, d).transpose(0, 2, 1, 3)              # [bc, h_kv, keys, d]
        kv = xp.ascontiguousarray(kv)
        pos = self._pos(keys)
        # Slots past the cache length may hold anything (NaN in the seed's test): zero them, so
        # that 0-probability · NaN never reaches P·V.
        xp.copyto(kv, 0, where=pos[:, None] >= length)                        # [bc, 1, keys, 1]
        scores = xp.matmul(qc, kv.swapaxes(-1, -2))                           # [bc, h_kv, rows, keys]
        scores *= self.scale
        xp.copyto(scores, -np.inf, where=pos >= limit)                        # [bc, 1, rows, keys]
        m = scores.max(axis=-1, keepdims=True)
        scores -= m
        xp.exp(scores, out=scores)
        s = scores.sum(axis=-1, keepdims=True)
        scores /= s
        o = xp.matmul(scores, kv[..., :self.dv])                              # [bc, h_kv, rows, dv]
        lse = (m + xp.log(s))[..., 0]                                         # [bc, h_kv, rows]
        o = o.reshape(bc, h_kv, self.s_q, self.heads_per_kv, self.dv).transpose(0, 2, 1, 3, 4)
        o = o.reshape(bc, self.s_q, self.h_q, self.dv)
        lse = lse.reshape(bc, h_kv, self.s_q, self.heads_per_kv).transpose(0, 1, 3, 2)
        return o, lse.reshape(bc, self.h_q, self.s_q)


def mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v: int = 512,
               softmax_scale: float | None = None, causal: bool = False, *,
               compute_dtype=np.float32, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES):
    """One call of paged MLA decoding in plain CuPy (or NumPy): ``(out, lse)``.

    ``compute_dtype=float64`` gives float64 out and lse (a reference); the default float32 returns
    out in q's dtype and lse in float32, like ``flash_mla_with_kvcache``.
    """
    b, s_q, h_q, d = q.shape
    _, page_block, h_kv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"q has head dim {d}, k_cache {dk}")
    plan = PagedMLA(block_table, cache_seqlens, s_q=s_q, h_q=h_q, h_kv=h_kv, page_block=page_block,
                    d=d, head_dim_v=head_dim_v, softmax_scale=softmax_scale, causal=causal,
                    compute_dtype=compute_dtype, workspace_bytes=workspace_bytes)
    return plan(q, k_cache)
