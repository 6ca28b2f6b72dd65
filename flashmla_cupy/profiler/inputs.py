"""Random inputs on the GPU, laid out as the seed's benchmark lays them out.

MLA: q ``[b, s_q, h_q, 576]`` and a KV cache ``[b · n, P, h_kv, 576]`` in pages of ``P =
shape.page_size`` tokens, request ``i`` owning pages ``i · n … i · n + n - 1`` (``n = max_seqlen_pad /
P``; ``block_table = arange``, as in the seed); standard-normal data; every cache slot at or past a
request's length is NaN (as in the seed), so a kernel that reads it shows it in ``--check``.
Generated per request's ``max_seqlen_pad`` tokens, in chunks of requests so that the float32
staging never exceeds ~1 GiB whatever the shape: the values depend on the seed and the padded
length, not on the page size. The FP8 cache (dtype ``fp8``): the same values quantized by
``quant.quantize_fp8_per_tensor`` at the fixed scale ``FP8_K_SCALE`` (uint8 e4m3 codes, the NaN
code past each request's length), and ``k_scale`` that scale as a float32 0-d array. An e4m3 q
(``q_dtype`` ``fp8``): the same q values quantized likewise at ``FP8_Q_SCALE``, and ``q_scale``.

Sparse (DeepSeek-V3.2): q bf16 ``[b, s_q, h_q, 576]``; an FP8 cache ``[num_blocks, 64, 1, 656]``
quantized (``flashmla_cupy.quant``) from standard-normal bf16 rows; ``indices [b, s_q, topk]``,
for request i distinct tokens of its own ``[i · s_k, (i + 1) · s_k)`` (each query token its own
draw, as upstream's test draws them); an attention sink ``[h_q]``. Also in chunks of tokens.

Attention: float32 q, k, v ``[B, H, N, d]``, standard normal.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

from .. import baselines, quant
from ..constants import FP8_TOKEN_BYTES
from .shapes import FP8_CACHE, FP8_Q, PAGE_BLOCK, AttentionShape, MLAShape, SparseShape

STAGING_BYTES = 1 << 30

# The FP8 cache's k_scale: what amax / 448 calibration gives for standard-normal values (amax is
# about 6 over the 10^8-10^9 values of a grid shape's cache; not a power of two, as calibrated
# scales are not). Fixed rather than computed from the data so that every chunk of the cache is
# quantized with the one scale the call reads.
FP8_K_SCALE = 6.0 / quant.E4M3_MAX
# An e4m3 q's q_scale, likewise: amax / 448 of standard-normal values, amax about 5 over the 10^6-10^7
# values of a grid shape's q (the rare larger ones saturate at 448, as under a calibrated scale).
FP8_Q_SCALE = 5.0 / quant.E4M3_MAX


def numpy_dtype(tag: str) -> np.dtype:
    """The array dtype of a dtype name; the FP8 cache's is uint8 (its e4m3 codes: CuPy has no
    float8 dtype)."""
    if tag == "bf16":
        return baselines.bfloat16_dtype()
    if tag == "fp16":
        return np.dtype(np.float16)
    if tag == "fp32":
        return np.dtype(np.float32)
    if tag == FP8_CACHE:
        return np.dtype(np.uint8)
    raise ValueError(f"unknown dtype {tag!r} (bf16, fp16, fp32 or {FP8_CACHE})")


@dataclass
class MLABenchInputs:
    shape: MLAShape
    q: object                  # cupy arrays
    k_cache: object
    block_table: object
    cache_seqlens: object
    k_scale: object = None     # the FP8 cache's scale, float32 0-d; None for a 16-bit cache
    q_scale: object = None     # an e4m3 q's scale, float32 0-d; None for a 16-bit q
    # The four arrays as torch tensors (DLPack views), made once by the first torch target.
    torch_views: tuple | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.q, self.k_cache, self.block_table, self.cache_seqlens))

    def format_kwargs(self, convert=lambda scale: scale) -> dict:
        """The keywords of ``flash_mla_with_kvcache`` that say the cache's and q's format: none for
        16-bit ones; is_fp8_kvcache and k_scale over the FP8 cache, and q_scale for an e4m3 q. Each
        scale goes through ``convert`` (the torch drop-in's: torch.from_dlpack)."""
        if self.k_scale is None:
            return {}
        kwargs = {"is_fp8_kvcache": True, "k_scale": convert(self.k_scale)}
        return kwargs if self.q_scale is None else {**kwargs, "q_scale": convert(self.q_scale)}


def _store(dst, src_f32, dtype, xp) -> None:
    """Write float32 values into a bf16/fp16 array (bf16 through its bits, rounded to nearest even)."""
    if baselines.is_bfloat16(dtype):
        dst.view(xp.uint16)[...] = baselines.from_float32(src_f32, dtype).view(xp.uint16)
    else:
        dst[...] = src_f32.astype(dtype)


def _store_cache(dst, src_f32, unread, xp) -> None:
    """Write float32 cache values into the cache, NaN where ``unread`` (the slots past a request's
    length); the FP8 cache gets their e4m3 codes at ``FP8_K_SCALE`` (quantized while all finite)."""
    if dst.dtype == np.uint8:
        codes, _ = quant.quantize_fp8_per_tensor(src_f32, scale=FP8_K_SCALE)
        dst[...] = xp.where(unread, np.uint8(quant.E4M3_NAN_CODE), codes)
    else:
        xp.copyto(src_f32, np.float32(np.nan), where=unread)
        _store(dst, src_f32, dst.dtype, xp)


def make_mla_inputs(shape: MLAShape, seed: int = 0, xp=None) -> MLABenchInputs:
    """The seed's layout on the GPU (``xp=numpy`` builds the same on the host, for tests)."""
    if xp is None:
        import cupy as xp

    gen = xp.random.default_rng(seed)
    b, s_q, h_q, h_kv, d = shape.batch, shape.s_q, shape.h_q, shape.h_kv, shape.d
    pad, page = shape.max_seqlen_pad, shape.page_size
    pages = pad // page

    q_values = gen.standard_normal((b, s_q, h_q, d), dtype=np.float32)
    if shape.q_dtype == FP8_Q:
        q, _ = quant.quantize_fp8_per_tensor(q_values, scale=FP8_Q_SCALE)
        q_scale = xp.asarray(FP8_Q_SCALE, dtype=np.float32)
    else:
        q, q_scale = xp.empty(q_values.shape, dtype=numpy_dtype(shape.q_dtype)), None
        _store(q, q_values, q.dtype, xp)
    del q_values

    k_cache = xp.empty((b * pages, page, h_kv, d), dtype=numpy_dtype(shape.dtype))
    per_request = k_cache.reshape(b, pad, h_kv, d)
    seqlens = np.asarray(shape.seqlens, dtype=np.int32)
    step = max(1, STAGING_BYTES // (pad * h_kv * d * 4))
    pos = xp.arange(pad, dtype=np.int32)
    for lo in range(0, b, step):
        hi = min(b, lo + step)
        block = gen.standard_normal((hi - lo, pad, h_kv, d), dtype=np.float32)
        lengths = xp.asarray(seqlens[lo:hi]).reshape(hi - lo, 1, 1, 1)
        _store_cache(per_request[lo:hi], block, pos[None, :, None, None] >= lengths, xp)
        del block
    block_table = xp.arange(b * pages, dtype=np.int32).reshape(b, pages)
    k_scale = xp.asarray(FP8_K_SCALE, dtype=np.float32) if shape.dtype == FP8_CACHE else None
    return MLABenchInputs(shape, q, k_cache, block_table, xp.asarray(seqlens), k_scale, q_scale)


@dataclass
class SparseBenchInputs:
    shape: SparseShape
    q: object                  # cupy arrays
    k_cache: object
    indices: object
    attn_sink: object
    cache_seqlens: object      # s_k per request: get_mla_metadata reads only its length here
    retrieved_tokens: int      # distinct cache tokens the indices name (the bytes' cache part)


def _distinct_tokens(gen, rows: int, s_k: int, topk: int, xp):
    """int32 ``[rows, topk]``: per row, ``topk`` distinct offsets in ``[0, s_k)`` (the head of a
    random permutation), in chunks of rows so that the sort keys stay within the staging size."""
    step = max(1, STAGING_BYTES // (s_k * 12))          # float32 keys + int64 order per token
    parts = []
    for lo in range(0, rows, step):
        keys = gen.random((min(step, rows - lo), s_k), dtype=np.float32)
        parts.append(xp.argsort(keys, axis=-1)[:, :topk].astype(np.int32))
        del keys
    return xp.concatenate(parts)


def make_sparse_inputs(shape: SparseShape, seed: int = 0, xp=None) -> SparseBenchInputs:
    """Random sparse-decoding inputs on the GPU (``xp=numpy``: on the host, for tests)."""
    if xp is None:
        import cupy as xp

    bf16 = baselines.bfloat16_dtype()
    gen = xp.random.default_rng(seed)
    b, s_q, h_q, s_k, d = shape.batch, shape.s_q, shape.h_q, shape.s_k, shape.d

    q = xp.empty((b, s_q, h_q, d), dtype=bf16)
    _store(q, gen.standard_normal(q.shape, dtype=np.float32), bf16, xp)

    k_cache = xp.empty((shape.num_blocks, PAGE_BLOCK, 1, FP8_TOKEN_BYTES), dtype=np.uint8)
    tokens = k_cache.reshape(-1, FP8_TOKEN_BYTES)
    step = max(1, STAGING_BYTES // (d * 4))
    for lo in range(0, tokens.shape[0], step):
        hi = min(tokens.shape[0], lo + step)
        rows = baselines.from_float32(gen.standard_normal((hi - lo, d), dtype=np.float32), bf16)
        tokens[lo:hi] = quant.quantize_fp8_sparse(rows)
        del rows

    offsets = _distinct_tokens(gen, b * s_q, s_k, shape.topk, xp).reshape(b, s_q, shape.topk)
    indices = offsets + (xp.arange(b, dtype=np.int32) * s_k).reshape(b, 1, 1)
    attn_sink = gen.standard_normal((h_q,), dtype=np.float32)
    return SparseBenchInputs(shape, q, k_cache, indices, attn_sink, xp.full((b,), s_k, dtype=np.int32),
                             int(xp.unique(indices).size))


@dataclass
class AttentionInputs:
    shape: AttentionShape
    q: object
    k: object
    v: object


def make_attention_inputs(shape: AttentionShape, seed: int = 0, xp=None) -> AttentionInputs:
    if xp is None:
        import cupy as xp

    gen = xp.random.default_rng(seed)
    dims = (shape.batch, shape.heads, shape.seqlen, shape.head_dim)
    q, k, v = (gen.standard_normal(dims, dtype=np.float32) for _ in range(3))
    return AttentionInputs(shape, q, k, v)


def free_gpu_memory() -> None:
    """Give cached blocks back to the driver (between shapes): CuPy's pools, and torch's caching
    allocator when a torch target has used it."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
