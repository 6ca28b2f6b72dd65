"""Workloads and their cost model (pure Python: no GPU, no CuPy).

MLA decoding shapes follow the seed's test and benchmark: head_dim_k 576 (512 + 64 rope), head_dim_v
512, pages of 64 tokens (or any power of two: ``page_size``), and per shape ``batch`` cache lengths:
all equal to the mean, or with ``varlen`` drawn from normal(mean, mean / 2), at least ``s_q``,
truncated to an integer. The draws come from one ``random.Random(seed)`` consumed in grid order
(batch, seqlen, h_q, s_q, varlen), which is exactly what the seed's test does after
``random.seed(0)``: with the default grid and seed 0 the cache lengths are the ones behind the
measured anchors. The grid is crossed with the page sizes innermost, without drawing again: a
shape's rows at each page size have the same cache lengths.

The dtype names the cache's elements: bf16 or fp16, or ``fp8``, the dense FP8 cache (float8_e4m3
codes with one float32 scale, vLLM's ``k_scale``). q's dtype (``q_dtype``) is the 16-bit cache's
own; over the FP8 cache it is bf16 or ``fp8``, e4m3 codes with one float32 scale (``q_scale``).
out is in q's dtype, bf16 for an e4m3 q.

FLOPs and bytes use the seed benchmark's formulas, with each array's own element size:

    FLOPs = 2 · s_q · Σseqlen · h_q · (d + dv)
    bytes = e_kv · Σseqlen · h_kv · d + e_q · b · s_q · h_q · d + e_out · b · s_q · h_q · dv

(the KV cache read once, q read once, the output written once; e_kv = 2 for bf16/fp16 and 1 for
fp8: 576 bytes a token; e_q = 2 for bf16/fp16 and 1 for an e4m3 q; e_out = 2). Both count
tokens, so the page size does not enter them.

Sparse decoding (DeepSeek-V3.2) is a list of production rows, each ``(b, h_q, s_q, s_k, topk)``:
request i owns ``s_k`` tokens of an FP8 cache (656 bytes a token) and each of its query tokens
attends to ``topk`` distinct ones. FLOPs and bytes follow upstream FlashMLA's
``tests/lib.py`` (``count_flop_and_mem_vol_for_decode``):

    FLOPs = 2 · h_q · (b · s_q · topk) · (d + dv)
    bytes = 2 · b · s_q · h_q · (d + dv) + 656 · retrieved

(q read and out written in bf16; ``retrieved`` = the distinct cache tokens the indices name, each
read once: a count on the drawn indices, so the bytes come from the inputs, not the shape alone).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from ..constants import FP8_TOKEN_BYTES

HEAD_DIM_K = 576
HEAD_DIM_V = 512
PAGE_BLOCK = 64            # tokens per cache page in the seed's layout: MLA's default, the sparse cache's
SEQLEN_PAD = 256           # the seed pads each request's cache to a multiple of 256 tokens

FP8_CACHE = "fp8"          # the dense FP8 cache: e4m3 codes (one byte), one scale (k_scale)
FP8_Q = "fp8"              # an e4m3 q over the FP8 cache: codes (one byte), one scale (q_scale); bf16 out
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, FP8_CACHE: 1}     # (FP8_Q's: FP8_CACHE's)

# The seed's test grid.
SEED_BATCHES = (128,)
SEED_SEQLENS = (4096, 8192, 16384)
SEED_HEADS = (16, 32, 64, 128)
SEED_S_Q = (1, 2)
SEED_VARLEN = (False, True)

# --quick: a few shapes of the default grid (same draws as in the full grid), for a README table.
QUICK_KEYS = (
    # (batch, mean seqlen, h_q, s_q, varlen)
    (128, 4096, 16, 1, False),     # memory-bound corner
    (128, 4096, 128, 1, False),    # balanced
    (128, 8192, 64, 2, True),      # varlen, MTP 2
    (128, 16384, 128, 2, False),   # compute-bound corner
)

# DeepSeek-V3.2's production grid for sparse decoding, the rows of FlashMLA's H200 anchor run
# (anchors.py): upstream's (9241ae3) "V3.2" performance cases (b 2, 64, 74, 128), b 128 at h_q 64
# and at s_q 1, and upstream's two peak cases at d_qk 576 (b 148, topk 16384).
SPARSE_PRODUCTION_GRID = (
    # (batch, h_q, s_q, s_k, topk)
    (2, 128, 2, 32768, 2048),
    (64, 128, 2, 32768, 2048),
    (74, 128, 2, 32768, 2048),
    (128, 128, 2, 32768, 2048),
    (128, 64, 2, 32768, 2048),
    (128, 128, 1, 32768, 2048),
    (148, 64, 2, 32768, 16384),
    (148, 128, 2, 32768, 16384),
)
SPARSE_QUICK_ROWS = 2          # --quick: the first rows (seconds, not minutes)

# Attention (seed 000): flash_attn_minimal vs manual attention on float32 [B, H, N, d].
ATTENTION_SEED_SHAPE = (16, 12, 64, 64)
ATTENTION_SWEEP_N = (64, 128, 256, 512, 1024, 2048, 4096)


def is_page_size(n: int) -> bool:
    """A page size the dense call takes: a power of two (1, 2, 4, ..., 64, ..., 256, ...)."""
    return n >= 1 and n & (n - 1) == 0


def q_dtypes(dtype: str) -> tuple[str, ...]:
    """The dtypes of q that read a cache of ``dtype``, the default first: a 16-bit cache's own;
    bf16 or an e4m3 q (``FP8_Q``) over the FP8 cache."""
    return ("bf16", FP8_Q) if dtype == FP8_CACHE else (dtype,)


def out_dtype(dtype: str) -> str:
    """out's dtype over a cache of ``dtype``: a 16-bit cache's (q's), bf16 over the FP8 cache
    whatever q's is."""
    return "bf16" if dtype == FP8_CACHE else dtype


def page_text(page_size: int) -> str:
    """`` page=P`` for a label, empty at the seed's 64 (its labels stay as they were)."""
    return "" if page_size == PAGE_BLOCK else f" page={page_size}"


@dataclass(frozen=True)
class MLAShape:
    """One decoding problem: ``batch`` requests, ``s_q`` query tokens each, a KV cache in pages of
    ``page_size`` tokens."""
    batch: int
    mean_seqlen: int
    h_q: int
    s_q: int
    varlen: bool
    seqlens: tuple[int, ...] = field(repr=False)
    h_kv: int = 1
    causal: bool = True
    dtype: str = "bf16"            # the cache's: bf16, fp16 or FP8_CACHE
    d: int = HEAD_DIM_K
    dv: int = HEAD_DIM_V
    page_size: int = PAGE_BLOCK
    q_dtype: str | None = None     # q's: one of ``q_dtypes(dtype)``; None: the first (bf16 over FP8_CACHE)

    def __post_init__(self):
        allowed = q_dtypes(self.dtype)
        if self.q_dtype is None:
            object.__setattr__(self, "q_dtype", allowed[0])      # (frozen: set once, here)
        elif self.q_dtype not in allowed:
            raise ValueError(f"q_dtype {self.q_dtype!r} does not read a {self.dtype} cache "
                             f"(q: {' or '.join(allowed)})")

    @property
    def total_seqlen(self) -> int:
        return sum(self.seqlens)

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens)

    @property
    def seqlen_mean(self) -> float:
        """The drawn lengths' mean (what the seed's CSV writes as ``seqlen``)."""
        return self.total_seqlen / len(self.seqlens)

    @property
    def max_seqlen_pad(self) -> int:
        """The longest length rounded up to the seed's 256 tokens, or to a whole page where pages
        are larger (both powers of two: the larger is a multiple of the smaller)."""
        unit = max(SEQLEN_PAD, self.page_size)
        return -(-self.max_seqlen // unit) * unit

    @property
    def num_blocks(self) -> int:
        """Pages in the KV cache as the seed lays it out: ``batch · max_seqlen_pad / page_size``."""
        return self.batch * self.max_seqlen_pad // self.page_size

    @property
    def key(self) -> tuple:
        """The grid coordinates the cache lengths are drawn for (the page size is not one)."""
        return (self.batch, self.mean_seqlen, self.h_q, self.s_q, self.varlen)

    def label(self) -> str:
        return (f"b={self.batch} s_k={self.mean_seqlen}{'~' if self.varlen else ''} "
                f"h_q={self.h_q} s_q={self.s_q}{page_text(self.page_size)}")

    def as_dict(self) -> dict:
        return {
            "batch": self.batch, "mean_seqlen": self.mean_seqlen, "seqlen_mean": self.seqlen_mean,
            "total_seqlen": self.total_seqlen, "max_seqlen": self.max_seqlen, "h_q": self.h_q,
            "h_kv": self.h_kv, "s_q": self.s_q, "varlen": self.varlen, "causal": self.causal,
            "dtype": self.dtype, "q_dtype": self.q_dtype, "d": self.d, "dv": self.dv, "page_size": self.page_size,
        }


def draw_seqlens(rng: random.Random, batch: int, mean: int, s_q: int, varlen: bool) -> tuple[int, ...]:
    """Cache lengths as the seed's test draws them (one ``normalvariate`` per request if varlen)."""
    if not varlen:
        return (int(mean),) * batch
    return tuple(int(max(rng.normalvariate(mean, mean / 2), s_q)) for _ in range(batch))


def mla_grid(batches=SEED_BATCHES, seqlens=SEED_SEQLENS, heads=SEED_HEADS, s_qs=SEED_S_Q,
             varlens=SEED_VARLEN, *, page_sizes=(PAGE_BLOCK,), h_kv: int = 1, causal: bool = True,
             dtype: str = "bf16", q_dtype: str | None = None, seed: int = 0) -> list[MLAShape]:
    """The grid in the seed test's order, cache lengths drawn from ``random.Random(seed)``; each
    shape once per page size (innermost), all with the lengths drawn for it."""
    for p in page_sizes:
        if not is_page_size(p):
            raise ValueError(f"page size {p} is not a power of two")
    rng = random.Random(seed)
    shapes = []
    for b in batches:
        for s in seqlens:
            for h_q in heads:
                if h_q % h_kv:
                    raise ValueError(f"h_q={h_q} is not a multiple of h_kv={h_kv}")
                for s_q in s_qs:
                    for varlen in varlens:
                        lens = draw_seqlens(rng, b, s, s_q, varlen)
                        shapes += [MLAShape(b, s, h_q, s_q, varlen, lens, h_kv=h_kv, causal=causal, dtype=dtype,
                                            page_size=p, q_dtype=q_dtype) for p in page_sizes]
    return shapes


def quick_grid(*, page_sizes=(PAGE_BLOCK,), h_kv: int = 1, causal: bool = True, dtype: str = "bf16",
               q_dtype: str | None = None, seed: int = 0) -> list[MLAShape]:
    """``--quick``: the QUICK_KEYS shapes at each page size, with the cache lengths they have in the
    full grid."""
    full = {(s.key, s.page_size): s for s in mla_grid(page_sizes=page_sizes, h_kv=h_kv, causal=causal,
                                                       dtype=dtype, q_dtype=q_dtype, seed=seed)}
    return [full[k, p] for k in QUICK_KEYS for p in page_sizes]


def element_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


def mla_flops(shape: MLAShape) -> int:
    """2 · s_q · Σseqlen · h_q · (d + dv): Q·Kᵀ over d and P·V over dv (the seed's count)."""
    return 2 * shape.s_q * shape.total_seqlen * shape.h_q * (shape.d + shape.dv)


def mla_bytes(shape: MLAShape) -> int:
    """e_kv · Σseqlen · h_kv · d + e_q · b · s_q · h_q · d + e_out · b · s_q · h_q · dv (the seed's
    count, each array at its own element size: the cache's, q's and out's)."""
    b, s_q, h_q = shape.batch, shape.s_q, shape.h_q
    return (element_bytes(shape.dtype) * shape.total_seqlen * shape.h_kv * shape.d
            + element_bytes(shape.q_dtype) * b * s_q * h_q * shape.d
            + element_bytes(out_dtype(shape.dtype)) * b * s_q * h_q * shape.dv)


# --------------------------------------------------------------------------------------------
# Sparse decoding (DeepSeek-V3.2, FP8 cache)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SparseShape:
    """``batch`` requests of ``s_q`` query tokens; request i owns cache tokens
    ``[i · s_k, (i + 1) · s_k)`` and each of its query tokens attends to ``topk`` distinct ones."""
    batch: int
    h_q: int
    s_q: int
    s_k: int
    topk: int
    d: int = HEAD_DIM_K
    dv: int = HEAD_DIM_V

    @property
    def num_blocks(self) -> int:
        """Pages of the FP8 cache: every request's ``s_k`` tokens, end to end."""
        return -(-self.batch * self.s_k // PAGE_BLOCK)

    @property
    def attended_tokens(self) -> int:
        """(query token, cache token) pairs: every index is valid."""
        return self.batch * self.s_q * self.topk

    @property
    def key(self) -> tuple:
        return (self.batch, self.h_q, self.s_q, self.s_k, self.topk)

    def label(self) -> str:
        return f"b={self.batch} h_q={self.h_q} s_q={self.s_q} s_k={self.s_k} topk={self.topk}"

    def as_dict(self) -> dict:
        return {"batch": self.batch, "h_q": self.h_q, "s_q": self.s_q, "s_k": self.s_k, "topk": self.topk,
                "d": self.d, "dv": self.dv}


def sparse_grid(batches=(), heads=(), s_qs=(), s_ks=(), topks=(), *, quick: bool = False) -> list[SparseShape]:
    """The production rows (``quick``: the first ``SPARSE_QUICK_ROWS``); a non-empty list replaces
    that column in every row (one row per value; duplicates dropped, order kept)."""
    rows = SPARSE_PRODUCTION_GRID[:SPARSE_QUICK_ROWS] if quick else SPARSE_PRODUCTION_GRID
    keys = {}
    for b, h_q, s_q, s_k, topk in rows:
        for key in itertools.product(batches or (b,), heads or (h_q,), s_qs or (s_q,), s_ks or (s_k,),
                                     topks or (topk,)):
            keys[key] = None
    grid = [SparseShape(*key) for key in keys]
    for s in grid:
        if s.topk > s.s_k:
            raise ValueError(f"topk={s.topk} is more than s_k={s.s_k}: a query token's indices are distinct "
                             f"tokens of its request's s_k")
    return grid


def sparse_flops(shape: SparseShape) -> int:
    """2 · h_q · (b · s_q · topk) · (d + dv): Q·Kᵀ and P·V over every attended token (upstream's count)."""
    return 2 * shape.h_q * shape.attended_tokens * (shape.d + shape.dv)


def sparse_bytes(shape: SparseShape, retrieved_tokens: int) -> int:
    """2 · b · s_q · h_q · (d + dv) + 656 · retrieved_tokens: q and out in bf16, and each distinct
    cache token the indices name read once (upstream's count)."""
    return 2 * shape.batch * shape.s_q * shape.h_q * (shape.d + shape.dv) + FP8_TOKEN_BYTES * retrieved_tokens


# --------------------------------------------------------------------------------------------
# Attention (seed 000)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool = False
    dtype: str = "fp32"

    def label(self) -> str:
        return f"B={self.batch} H={self.heads} N={self.seqlen} d={self.head_dim}"

    def as_dict(self) -> dict:
        return {"batch": self.batch, "heads": self.heads, "seqlen": self.seqlen,
                "head_dim": self.head_dim, "causal": self.causal, "dtype": self.dtype}


def attention_grid(batch=16, heads=12, head_dim=64, seqlens=ATTENTION_SWEEP_N, *,
                   causal: bool = False) -> list[AttentionShape]:
    return [AttentionShape(batch, heads, n, head_dim, causal) for n in seqlens]


def attention_flops(shape: AttentionShape) -> int:
    """4 · B · H · N² · d (Q·Kᵀ and P·V), halved when causal (only the lower triangle counts)."""
    f = 4 * shape.batch * shape.heads * shape.seqlen * shape.seqlen * shape.head_dim
    return f // 2 if shape.causal else f


def attention_bytes(shape: AttentionShape) -> int:
    """The fewest bytes: q, k, v read once, o written once (float32)."""
    return 4 * element_bytes(shape.dtype) * shape.batch * shape.heads * shape.seqlen * shape.head_dim
