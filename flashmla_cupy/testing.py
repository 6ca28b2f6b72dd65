"""Random MLA decoding inputs that catch kernels reading what they must not (tests, fuzzing, tools).

Every input is fresh random data (never zeros). The KV cache holds the requests' pages at
randomly permuted block ids among spare blocks; every slot no request may read (spare blocks,
tokens past a request's length) is NaN, and block-table columns past a request's pages hold
garbage ids, so a kernel that reads anything it should not produces NaN or a fault.

The dtype "fp8" is the dense FP8 cache: bf16 q, e4m3 codes (NaN codes in the unreadable slots)
with the scale ``FP8_SCALE`` in ``MLACase.k_scale``; "fp8q" is that cache with an e4m3 q (scale
``FP8_Q_SCALE`` in ``MLACase.q_scale``). Both give bf16 outputs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cupy
import ml_dtypes
import numpy as np

import flashmla_cupy
from flashmla_cupy import checks, quant, reference

PAGE = 64             # FlashMLA's page block size: the cases' default
D_K = 576
D_V = 512

DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}
FP8_SCALE = 0.0371      # the FP8 cases' k_scale: not a power of two; N(0, 1) values saturate past 16.6
FP8_Q_SCALE = 0.0157    # "fp8q" cases' q_scale: not a power of two; N(0, 1) q saturates past 7.0
FP8_CASES = ("fp8", "fp8q")


def q_dtype(dtype: str) -> str:
    """q's dtype for a case dtype ("fp8": the FP8 cache, with bf16 q; "fp8q": e4m3 q)."""
    return {"fp8": "bf16", "fp8q": "e4m3"}.get(dtype, dtype)


@dataclass
class MLACase:
    q: cupy.ndarray
    k_cache: cupy.ndarray
    block_table: cupy.ndarray
    cache_seqlens: cupy.ndarray
    seqlens: np.ndarray            # host copy
    s_q: int
    h_q: int
    h_kv: int
    k_scale: cupy.ndarray | None = None    # the FP8 cache's scale (k_cache: e4m3 codes); None: 16-bit
    q_scale: cupy.ndarray | None = None    # an e4m3 q's scale (q: e4m3 codes); None: q in 16 bits

    def to_host(self) -> "MLACase":
        """The same case with NumPy copies of the arrays (for a reference computed on the CPU)."""
        return dataclasses.replace(self, q=cupy.asnumpy(self.q), k_cache=cupy.asnumpy(self.k_cache),
                                   block_table=cupy.asnumpy(self.block_table),
                                   cache_seqlens=cupy.asnumpy(self.cache_seqlens),
                                   k_scale=None if self.k_scale is None else cupy.asnumpy(self.k_scale),
                                   q_scale=None if self.q_scale is None else cupy.asnumpy(self.q_scale))

    def cache_kwargs(self) -> dict:
        """The keywords of ``flash_mla_with_kvcache`` that describe the cache's (and q's) format."""
        if self.k_scale is None:
            return {}
        kwargs = {"is_fp8_kvcache": True, "k_scale": self.k_scale}
        return kwargs if self.q_scale is None else {**kwargs, "q_scale": self.q_scale}

    @property
    def out_dtype(self) -> np.dtype:
        """out's dtype: q's, bf16 for an e4m3 q."""
        return checks.out_dtype(self.q.dtype)

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1]

    def pages(self, request: int) -> int:
        """Cache pages (block-table columns) that request ``request`` reads."""
        return -(-int(self.seqlens[request]) // self.page_size)

    def describe(self) -> str:
        b = len(self.seqlens)
        dtype = self.q.dtype if self.k_scale is None else \
            f"{'e4m3' if self.q_scale is not None else self.q.dtype} q, fp8 cache"
        return (f"b={b} s_q={self.s_q} h_q={self.h_q} h_kv={self.h_kv} page={self.page_size} dtype={dtype} "
                f"seqlens[:8]={self.seqlens[:8].tolist()}")


def seed_seqlens(rng: np.random.Generator, batch: int, mean: int, s_q: int, varlen: bool) -> np.ndarray:
    """FlashMLA's test draw: mean for all, or normal(mean, mean/2) clipped to at least s_q."""
    if not varlen:
        return np.full(batch, mean, dtype=np.int32)
    return np.maximum(rng.normal(mean, mean / 2, batch), s_q).astype(np.int32)


def make_inputs(rng: np.random.Generator, seqlens, s_q: int, h_q: int, h_kv: int, dtype: str,
                spare_blocks: int = 3, garbage_columns: int = 2, page_size: int = PAGE) -> MLACase:
    seqlens = np.asarray(seqlens, dtype=np.int32)
    batch = len(seqlens)
    pages = -(-seqlens // page_size)
    used = int(pages.sum())
    num_blocks = used + spare_blocks
    ids = rng.permutation(num_blocks).astype(np.int32)
    width = int(pages.max(initial=0)) + garbage_columns
    table = rng.integers(num_blocks, 2**31 - 1, size=(batch, max(width, 1)), dtype=np.int32)
    table[:, ::2] = -1 - table[:, ::2] % 1000                # garbage: negative or huge ids
    valid_tokens = np.zeros(num_blocks, dtype=np.int32)     # per block id: readable tokens
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = ids[start:start + n]
        valid_tokens[ids[start:start + n]] = np.clip(seqlens[i] - page_size * np.arange(n), 0, page_size)
        start += n

    q_scale = None
    if dtype == "fp8q":
        q, _ = quant.quantize_fp8_per_tensor(_random(rng, (batch, s_q, h_q, D_K), "fp32"), scale=FP8_Q_SCALE)
        q_scale = cupy.full((), FP8_Q_SCALE, dtype=np.float32)
    else:
        q = _random(rng, (batch, s_q, h_q, D_K), q_dtype(dtype))
    fp8 = dtype in FP8_CASES
    k_cache = cupy.empty((num_blocks, page_size, h_kv, D_K), dtype=np.uint8 if fp8 else DTYPES[dtype])
    valid = cupy.asarray(valid_tokens)
    chunk = max(1, (1 << 27) // (page_size * h_kv * D_K))    # ~0.5 GB of float32 at a time
    gen = cupy.random.default_rng(int(rng.integers(2**63)))
    for lo in range(0, num_blocks, chunk):
        hi = min(num_blocks, lo + chunk)
        block = gen.standard_normal((hi - lo, page_size, h_kv, D_K), dtype=np.float32)
        unreadable = cupy.arange(page_size)[:, None, None] >= valid[lo:hi, None, None, None]
        if fp8:
            codes, _ = quant.quantize_fp8_per_tensor(block, scale=FP8_SCALE)
            k_cache[lo:hi] = cupy.where(unreadable, np.uint8(quant.E4M3_NAN_CODE), codes)
        else:
            k_cache[lo:hi] = cupy.where(unreadable, np.float32(np.nan), block).astype(DTYPES[dtype])
    k_scale = cupy.full((), FP8_SCALE, dtype=np.float32) if fp8 else None
    return MLACase(q, k_cache, cupy.asarray(table), cupy.asarray(seqlens), seqlens, s_q, h_q, h_kv, k_scale, q_scale)


def _random(rng: np.random.Generator, shape, dtype: str) -> cupy.ndarray:
    gen = cupy.random.default_rng(int(rng.integers(2**63)))
    return gen.standard_normal(shape, dtype=np.float32).astype(DTYPES[dtype])


def poisoned(shape, dtype) -> cupy.ndarray:
    """An output buffer full of NaN: any element the kernel fails to write stays NaN."""
    return cupy.full(shape, np.nan, dtype=np.float32).astype(dtype)


# |out - ref| <= atol + rtol * |ref|: P and O are rounded to the input precision (bf16: 8 bits,
# fp16: 11 bits of mantissa); lse is computed in fp32 from fp32 scores. The FP8 cache with a bf16
# q: P is fp16 (K, V and Q are exact in fp16 against the dequantized reference) but O is bf16,
# whose rounding dominates: bf16's bound.
OUT_TOL = {"bf16": (1e-2, 1e-2), "fp16": (2e-3, 2e-3), "fp8": (1e-2, 1e-2), "fp8q": (1e-2, 1e-2)}
# An e4m3 q: P V is an FP8 WGMMA, P rounded to e4m3 (3 mantissa bits, the cache's own precision):
# each weight within 2^-4 of itself, so out moves by up to 2^-4 sum p|v| / sum p (the reference
# with abs_values) beyond the bound above. (Weights below 2^-10 of their row's running max turn
# subnormal, each then within 2^-14 of that max: on the tests' scores a few such tokens, well
# inside atol.) cos_diff: reference.COS_DIFF_LIMITS.
P_ROUNDING = {"fp8q": 2.0 ** -4}
# lse: |lse - ref| <= atol + rtol |ref|. An e4m3 q's QK^T is an FP8 WGMMA, whose adder keeps about
# 14 bits of the running sum (DeepSeek-V3's report, 3.3.2), so each of its 18 k-steps of 32 may
# lose ~2^-14 of the partial score: up to 3.2e-3 in lse on the H100 over test_fp8's shapes, hence
# 1e-2 there (1e-3 everywhere else).
LSE_TOL = {"fp8q": (1e-2, 1e-5)}
LSE_TOL_DEFAULT = (1e-3, 1e-5)


def run_kernel(inp: MLACase, causal: bool, softmax_scale=None):
    """get_mla_metadata + flash_mla_with_kvcache into NaN-poisoned outputs."""
    metadata, num_splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, inp.s_q * inp.h_q // inp.h_kv, inp.h_kv)
    b = len(inp.seqlens)
    out = poisoned((b, inp.s_q, inp.h_q, 512), inp.out_dtype)
    lse = poisoned((b, inp.h_q, inp.s_q), np.float32)
    res = flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512,
                                               metadata, num_splits, softmax_scale=softmax_scale,
                                               causal=causal, out=out, lse=lse, **inp.cache_kwargs())
    assert res[0] is out and res[1] is lse
    return out, lse


def check_against_reference(inp: MLACase, out, lse, causal: bool, dtype: str, softmax_scale=None):
    """Assert that (out, lse) match the float64 reference (tolerances above); return the errors.

    ``inp``, ``out`` and ``lse`` are all CuPy arrays, or all NumPy (``inp.to_host()``: the
    reference and the comparison then run on the CPU, e.g. under compute-sanitizer).
    """
    xp = cupy.get_array_module(out)
    ref_out, ref_lse = reference.mla_decode(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512,
                                            softmax_scale=softmax_scale, causal=causal, k_scale=inp.k_scale,
                                            q_scale=inp.q_scale)
    out64 = reference.to_float64(out)
    lse64 = lse.astype(np.float64)
    what = inp.describe() + f" causal={causal}"

    assert bool(xp.isfinite(out64).all()), f"non-finite out (unwritten or NaN leak): {what}"
    assert bool((xp.isinf(lse64) == xp.isinf(ref_lse)).all()), f"+inf lse rows differ: {what}"
    assert not bool(xp.isnan(lse64).any()), f"NaN lse: {what}"
    finite = xp.isfinite(ref_lse)

    atol, rtol = OUT_TOL[dtype]
    bound = atol + rtol * xp.abs(ref_out)
    if dtype in P_ROUNDING:
        bound = bound + P_ROUNDING[dtype] * reference.mla_decode(
            inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, softmax_scale=softmax_scale,
            causal=causal, k_scale=inp.k_scale, q_scale=inp.q_scale, abs_values=True)[0]
    out_excess = float(xp.max(xp.abs(out64 - ref_out) - bound))
    assert out_excess <= 0, f"out error beyond {atol}+{rtol}|ref| (+ P's rounding) by {out_excess:.3g}: {what}"
    latol, lrtol = LSE_TOL.get(dtype, LSE_TOL_DEFAULT)
    lse_diff = xp.where(finite, lse64, 0) - xp.where(finite, ref_lse, 0)   # no inf - inf
    lse_err = xp.where(finite, xp.abs(lse_diff) - (latol + lrtol * xp.abs(ref_lse)), 0)
    assert float(lse_err.max()) <= 0, f"lse error beyond tolerance by {float(lse_err.max()):.3g}: {what}"

    cos_out = reference.cos_diff(out64, ref_out)
    cos_lse = reference.cos_diff(xp.where(finite, lse64, 0), xp.where(finite, ref_lse, 0))
    cos_out_tol, cos_lse_tol = reference.COS_DIFF_LIMITS.get(dtype, reference.COS_DIFF_LIMITS_DEFAULT)
    assert cos_out < cos_out_tol and (cos_lse_tol is None or cos_lse < cos_lse_tol), \
        f"cos_diff out {cos_out:.3g} lse {cos_lse:.3g}: {what}"
    return {"max_abs_out": reference.max_abs_error(out64, ref_out),
            "max_abs_lse": reference.max_abs_error(lse64, ref_lse), "cos_diff_out": cos_out,
            "cos_diff_lse": cos_lse}


# --- bad values (tests/test_values.py, tools/check_mla.py --set bad-values) ----------------------

@dataclass(frozen=True)
class BadValue:
    """One wrong value written into a request's ``cache_seqlens`` entry or block-table entry."""
    argument: str                 # "cache_seqlens" or "block_table"
    request: int
    value: int
    column: int = 0               # block_table only

    @property
    def message(self) -> str:
        """How the error names it (the start of the ValueError's message)."""
        if self.argument == "cache_seqlens":
            return f"cache_seqlens[{self.request}] must be in [0, "
        return f"block_table[{self.request}, {self.column}] must be a block of k_cache"

    def describe(self) -> str:
        where = f"[{self.request}]" if self.argument == "cache_seqlens" else f"[{self.request}, {self.column}]"
        return f"{self.argument}{where} = {self.value}"


SENTINEL = 0.5        # outputs start finite: NaN must come from the kernels, unwritten rows fail the reference
# Metadata of another batch (ERROR_SCHEDULE) or of another kind of call (ERROR_METADATA_KIND:
# dense vs sparse, another topk): both messages start with SCHEDULE_ERROR.
SCHEDULE_ERROR = "tile_scheduler_metadata and num_splits must come from get_mla_metadata"
METADATA_KIND_ERROR = SCHEDULE_ERROR + " for this call: "

# Every kind of int32 the kernels must survive (negative, just past the bound, huge, the extremes).
BAD_LENGTHS = {       # cache_seqlens[request]: outside [0, page_block_size * block_table columns]
    "-1": lambda inp: -1,
    "-2**31": lambda inp: -2**31,
    "capacity+1": lambda inp: inp.page_size * inp.block_table.shape[1] + 1,
    "2**30": lambda inp: 2**30,
    "2**31-1": lambda inp: 2**31 - 1,
}
BAD_BLOCK_IDS = {     # block_table[request, column]: outside [0, num_blocks)
    "-1": lambda inp: -1,
    "num_blocks": lambda inp: inp.k_cache.shape[0],
    "2**31-1": lambda inp: 2**31 - 1,
    "-2**31": lambda inp: -2**31,
}


def bad_value(inp: MLACase, request: int, argument: str, name: str, page: str = "first") -> BadValue:
    """``BAD_LENGTHS[name]`` for the request's length, or ``BAD_BLOCK_IDS[name]`` for the block
    id of its first or last page."""
    if argument == "cache_seqlens":
        return BadValue("cache_seqlens", request, BAD_LENGTHS[name](inp))
    return BadValue("block_table", request, BAD_BLOCK_IDS[name](inp),
                    column=0 if page == "first" else inp.pages(request) - 1)


def bad_value_kinds(causal: bool) -> list[tuple[str, str, str]]:
    """``(argument, name, page)`` of every bad value: block ids in the request's first page, and in
    its last one without a causal mask (with one, some query rows skip the last page, and only the
    rows that read a bad id are NaN)."""
    kinds = [("cache_seqlens", name, "") for name in BAD_LENGTHS]
    for page in ("first",) if causal else ("first", "last"):
        kinds += [("block_table", name, page) for name in BAD_BLOCK_IDS]
    return kinds


def bad_values(inp: MLACase, request: int, causal: bool) -> list[BadValue]:
    """Every bad value (``bad_value_kinds``) for one request."""
    return [bad_value(inp, request, argument, name, page) for argument, name, page in bad_value_kinds(causal)
            if page != "last" or inp.pages(request) > 1]


def apply_bad_value(inp: MLACase, bad: BadValue, value: int | None = None) -> None:
    """Write ``bad`` (or ``value`` in its place) into the case's GPU arrays (``inp.seqlens``
    keeps the good lengths)."""
    value = bad.value if value is None else value
    if bad.argument == "cache_seqlens":
        inp.cache_seqlens[bad.request] = value
    else:
        inp.block_table[bad.request, bad.column] = value


def finite_outputs(inp: MLACase):
    """``out`` and ``lse`` for ``inp``, full of a finite value (``SENTINEL``)."""
    b = len(inp.seqlens)
    out = cupy.full((b, inp.s_q, inp.h_q, D_V), SENTINEL, dtype=np.float32).astype(inp.out_dtype)
    return out, cupy.full((b, inp.h_q, inp.s_q), SENTINEL, dtype=np.float32)


# Scheduler metadata of another batch: (name, edit of (metadata, num_splits, rng), whether the
# kernels must report it). For a batch whose request 0 is split and started by SM part 0 (e.g.
# lengths [3000, 100, 5000, 1, 0, 700] with 16 query rows), a wrong split index is always found.
# Slot 5 of a row is the topk the metadata was computed for (-1: dense) and is checked before the
# rest: the edits of the schedule itself (slots 0-4) leave it alone, so that they reach the kernel.
FOREIGN_METADATA = [
    ("num_splits-1e9", lambda m, s, rng: s.fill(10**9), True),
    ("num_splits--5", lambda m, s, rng: s.fill(-5), True),
    ("num_splits-tail-1e9", lambda m, s, rng: s[1:].fill(10**9), True),
    ("num_splits-int32-extremes", lambda m, s, rng: s.__setitem__(slice(None), cupy.asarray(
        np.resize(np.array([2**31 - 1, -2**31], np.int32), s.shape))), True),
    ("metadata-begin_req--3", lambda m, s, rng: m[0].__setitem__(0, -3), True),
    ("metadata-all-idle", lambda m, s, rng: m[:, 0].fill(10**6), False),
    ("metadata-end-past-batch", lambda m, s, rng: (m[:, 2].fill(10**9), m[:, 3].fill(2**31 - 1)), False),
    ("metadata-zeros", lambda m, s, rng: m[:, :5].fill(0), False),
    ("metadata-all-zeros", lambda m, s, rng: m.fill(0), True),                 # topk 0 in every row
    ("metadata-sparse-topk", lambda m, s, rng: m[:, 5].fill(2048), True),      # computed for sparse decoding
    # Parts that start at request >= 1 end before they begin: the kernel must not start loading
    # pages it will never wait for.
    ("metadata-end-before-begin", lambda m, s, rng: m[:, 2].fill(0), False),
    ("metadata-random", lambda m, s, rng: m.__setitem__((slice(None), slice(0, 5)), cupy.asarray(
        rng.integers(-2**31, 2**31, (m.shape[0], 5), dtype=np.int64).astype(np.int32))), False),
    ("both-random", lambda m, s, rng: (m.__setitem__((slice(None), slice(0, 5)), cupy.asarray(
        rng.integers(-4, 40, (m.shape[0], 5)).astype(np.int32))), s.__setitem__(slice(None), cupy.asarray(
            rng.integers(-4, 200, s.shape).astype(np.int32)))), False),
]


def check_bad_value_result(inp: MLACase, bad: BadValue, out, lse, causal: bool, dtype: str) -> None:
    """The bad request's out rows and lse entries are all NaN; every other request matches the
    float64 reference (computed from the good values)."""
    xp = cupy.get_array_module(out)
    i = bad.request
    assert bool(xp.isnan(out[i].astype(np.float32)).all()), f"{bad.describe()}: out[{i}] is not all NaN"
    assert bool(xp.isnan(lse[i]).all()), f"{bad.describe()}: lse[{i}] is not all NaN"
    good = np.array([j for j in range(len(inp.seqlens)) if j != i])
    if good.size == 0:
        return
    table = inp.block_table.copy()
    if bad.argument == "block_table":      # the reference must not see the bad id (in a column it reads)
        table[i, bad.column] = 0
    sub = dataclasses.replace(inp, q=inp.q[good], block_table=table[good], seqlens=inp.seqlens[good],
                              cache_seqlens=xp.asarray(inp.seqlens[good]))
    check_against_reference(sub, out[good], lse[good], causal, dtype)
