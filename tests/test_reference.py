"""CPU tests of the float64 references (flashmla_cupy.reference).

``mla_decode`` (paged, vectorized) is checked element by element against ``mla_decode_dense``
(naive loops on a dense copy of the cache) and against small cases computed by hand; every
slot of the cache that no request may read holds NaN, and block-table columns past a request's
pages hold out-of-range ids, so reading anything it should not fails loudly. Each test draws a
fresh seed, printed (pytest shows it on failure); ``FLASHMLA_CUPY_TEST_SEED`` replays one.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from flashmla_cupy import reference

DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}
TIGHT = dict(rtol=1e-10, atol=1e-13)   # two float64 computations of the same numbers


def paged_case(rng, seqlens, s_q, h_q, h_kv, d, page=64, dtype="fp32", spare_pages=3):
    """Random q, a paged cache, its block table, and the dense twin of the cache.

    The requests' pages sit at random ids among spare pages. The dense copy ``[b, max_seqlen,
    h_kv, d]`` is filled token by token from the same values; both hold NaN wherever no request
    may read.
    """
    seqlens = np.asarray(seqlens, dtype=np.int32)
    batch = len(seqlens)
    pages = -(-seqlens // page)
    num_blocks = int(pages.sum()) + spare_pages
    page_ids = rng.permutation(num_blocks).astype(np.int32)
    # Columns past a request's pages point outside the cache: reading one raises IndexError.
    table = np.full((batch, int(pages.max()) + 2), num_blocks + 1000, dtype=np.int32)
    k_cache = np.full((num_blocks, page, h_kv, d), np.nan, dtype=np.float32)
    k_dense = np.full((batch, max(int(seqlens.max()), 1), h_kv, d), np.nan, dtype=np.float32)
    first = 0
    for i, n in enumerate(pages):
        table[i, :n] = page_ids[first:first + n]
        first += n
        k_dense[i, :seqlens[i]] = rng.standard_normal((seqlens[i], h_kv, d))
        for j in range(seqlens[i]):
            k_cache[table[i, j // page], j % page] = k_dense[i, j]
    q = rng.standard_normal((batch, s_q, h_q, d)).astype(np.float32)
    dt = DTYPES[dtype]
    return q.astype(dt), k_cache.astype(dt), table, seqlens, k_dense.astype(dt)


def empty_rows(seqlens, s_q, h_q, causal):
    """[b, h_q, s_q]: rows that see no key (written from the causal rule, not from the code)."""
    visible = np.asarray(seqlens)[:, None] - (causal * (s_q - 1 - np.arange(s_q)))[None, :]
    return np.broadcast_to((visible <= 0)[:, None, :], (len(seqlens), h_q, s_q))


# --- mla_decode against the dense loops ---------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h_kv", [1, 2])
@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_mla_decode_matches_dense(rng, s_q, h_kv, causal, dtype):
    # Empty requests, fewer tokens than query tokens, page boundaries +-1, and random lengths.
    seqlens = [0, 1, max(s_q - 1, 0), 63, 64, 65, 200, *rng.integers(1, 300, 2)]
    seqlens = rng.permutation(seqlens)
    h_q = 6 * h_kv
    q, k_cache, table, seqlens, k_dense = paged_case(rng, seqlens, s_q, h_q, h_kv, d=576, dtype=dtype)

    out, lse = reference.mla_decode(q, k_cache, table, seqlens, 512, causal=causal)
    want_out, want_lse = reference.mla_decode_dense(q, k_dense, seqlens, 512, causal=causal)

    assert out.dtype == lse.dtype == np.float64
    assert out.shape == (len(seqlens), s_q, h_q, 512) and lse.shape == (len(seqlens), h_q, s_q)
    np.testing.assert_allclose(out, want_out, **TIGHT)
    np.testing.assert_allclose(lse, want_lse, **TIGHT)
    empty = empty_rows(seqlens, s_q, h_q, causal)
    np.testing.assert_array_equal(np.isposinf(lse), empty)
    assert (out.transpose(0, 2, 1, 3)[empty] == 0).all()
    assert np.isfinite(out).all()


def test_mla_decode_other_shapes(rng):
    """Nothing assumes DeepSeek's sizes: head dims 40/24, pages of 16 tokens, 3 kv heads, a scale."""
    seqlens = [5, 16, 17, 0, 50]
    q, k_cache, table, seqlens, k_dense = paged_case(rng, seqlens, 3, 9, 3, d=40, page=16)
    for causal in (False, True):
        out, lse = reference.mla_decode(q, k_cache, table, seqlens, 24, softmax_scale=0.3, causal=causal)
        want_out, want_lse = reference.mla_decode_dense(q, k_dense, seqlens, 24, softmax_scale=0.3, causal=causal)
        np.testing.assert_allclose(out, want_out, **TIGHT)
        np.testing.assert_allclose(lse, want_lse, **TIGHT)


def test_mla_decode_by_hand():
    """One request of 2 tokens, q = [1, 0], keys [1, 0] and [0, 1], V = first column, scale 1.

    Scores 1 and 0: out = e / (e + 1), lse = log(e + 1). With two query tokens and causal, token 0
    sees only key 0 (out = 1, lse = 1) and token 1 sees both.
    """
    k_cache = np.array([[[[1.0, 0.0]], [[0.0, 1.0]]]])              # [1 block, page 2, 1 head, 2]
    table, seqlens = np.array([[0]], dtype=np.int32), np.array([2], dtype=np.int32)
    q = np.array([[[[1.0, 0.0]]]])                                    # [1, s_q 1, 1 head, 2]
    out, lse = reference.mla_decode(q, k_cache, table, seqlens, 1, softmax_scale=1.0)
    assert out.shape == (1, 1, 1, 1)
    assert out[0, 0, 0, 0] == pytest.approx(math.e / (math.e + 1), rel=1e-15)
    assert lse[0, 0, 0] == pytest.approx(math.log(math.e + 1), rel=1e-15)

    q2 = np.concatenate([q, q], axis=1)                              # s_q = 2
    out, lse = reference.mla_decode(q2, k_cache, table, seqlens, 1, softmax_scale=1.0, causal=True)
    assert out[0, :, 0, 0] == pytest.approx([1.0, math.e / (math.e + 1)], rel=1e-15)
    assert lse[0, 0, :] == pytest.approx([1.0, math.log(math.e + 1)], rel=1e-15)


def test_abs_values_weights_the_magnitudes_of_v():
    """Keys [1, 0] and [-1, 0] (V = first column: 1 and -1), q = [1, 0], scale 1: weights e and
    1/e over their sum. out = (e - 1/e) / (e + 1/e); with abs_values, (e + 1/e) / (e + 1/e) = 1,
    and the scores (lse) are K's own, not |K|'s."""
    k_cache = np.array([[[[1.0, 0.0]], [[-1.0, 0.0]]]])
    table, seqlens = np.array([[0]], dtype=np.int32), np.array([2], dtype=np.int32)
    q = np.array([[[[1.0, 0.0]]]])
    out, lse = reference.mla_decode(q, k_cache, table, seqlens, 1, softmax_scale=1.0)
    abs_out, abs_lse = reference.mla_decode(q, k_cache, table, seqlens, 1, softmax_scale=1.0, abs_values=True)
    e = math.e
    assert out[0, 0, 0, 0] == pytest.approx((e - 1 / e) / (e + 1 / e), rel=1e-15)
    assert abs_out[0, 0, 0, 0] == pytest.approx(1.0, rel=1e-15)
    assert abs_lse[0, 0, 0] == lse[0, 0, 0] == pytest.approx(math.log(e + 1 / e), rel=1e-15)


def test_mla_decode_never_reads_past_seqlen(rng):
    """NaN in unread cache slots and garbage block-table columns change nothing, bit for bit."""
    q, k_cache, table, seqlens, _ = paged_case(rng, [3, 64, 100, 0, 130], 2, 4, 1, d=576, dtype="bf16")
    out, lse = reference.mla_decode(q, k_cache, table, seqlens, 512, causal=True)
    assert np.isfinite(out).all() and not np.isnan(lse).any()

    clean_cache = k_cache.astype(np.float32)
    unread = np.isnan(clean_cache)
    assert unread.any()                    # the case does poison something
    clean_cache[unread] = rng.uniform(-1e4, 1e4, int(unread.sum()))
    clean_table = np.where(table < len(k_cache), table, 0).astype(np.int32)
    clean_out, clean_lse = reference.mla_decode(q, clean_cache.astype(k_cache.dtype), clean_table, seqlens, 512,
                                                causal=True)
    np.testing.assert_array_equal(out, clean_out)
    np.testing.assert_array_equal(lse, clean_lse)


# --- the cross-check is able to fail ------------------------------------------------------

def test_wrong_causal_flag_changes_the_answer(rng):
    q, k_cache, table, seqlens, k_dense = paged_case(rng, [70, 5], 2, 4, 1, d=64)
    causal_out, _ = reference.mla_decode(q, k_cache, table, seqlens, 32, causal=True)
    full_out, _ = reference.mla_decode(q, k_cache, table, seqlens, 32, causal=False)
    want_out, _ = reference.mla_decode_dense(q, k_dense, seqlens, 32, causal=True)
    np.testing.assert_allclose(causal_out, want_out, **TIGHT)
    assert not np.allclose(full_out[:, 0], want_out[:, 0], rtol=1e-6)   # token 0 loses one key
    np.testing.assert_allclose(full_out[:, 1], want_out[:, 1], **TIGHT)  # the last token sees all


def test_host_side_comparison_accepts_the_reference_and_catches_one_bad_element(rng):
    """testing.check_against_reference on NumPy arrays (check_mla --host-reference's path)."""
    testing = pytest.importorskip("flashmla_cupy.testing")
    q, k_cache, table, seqlens, _ = paged_case(rng, [70, 0, 130], 2, 4, 1, d=576, dtype="bf16")
    case = testing.MLACase(q, k_cache, table, seqlens, seqlens, 2, 4, 1)
    ref_out, ref_lse = reference.mla_decode(q, k_cache, table, seqlens, 512, causal=True)
    out, lse = ref_out.astype(np.float32).astype(q.dtype), ref_lse.astype(np.float32)
    err = testing.check_against_reference(case, out, lse, True, "bf16")
    assert err["cos_diff_out"] < 1e-5
    out[2, 1, 3, 100] += 1.0
    with pytest.raises(AssertionError, match="out error beyond"):
        testing.check_against_reference(case, out, lse, True, "bf16")


def test_causal_is_moot_for_one_query_token(rng):
    q, k_cache, table, seqlens, _ = paged_case(rng, [70, 5], 1, 4, 1, d=64)
    for a, b in zip(reference.mla_decode(q, k_cache, table, seqlens, 32, causal=True),
                    reference.mla_decode(q, k_cache, table, seqlens, 32, causal=False)):
        np.testing.assert_array_equal(a, b)


def test_block_table_and_kv_heads_matter(rng):
    """Trading a page between two requests, or swapping the two kv heads, changes the answer."""
    q, k_cache, table, seqlens, _ = paged_case(rng, [128, 128], 1, 4, 2, d=64)
    out, _ = reference.mla_decode(q, k_cache, table, seqlens, 32)
    swapped_pages = table.copy()
    swapped_pages[:, 0] = table[::-1, 0]
    out_pages, _ = reference.mla_decode(q, k_cache, swapped_pages, seqlens, 32)
    out_heads, _ = reference.mla_decode(q, k_cache[:, :, ::-1], table, seqlens, 32)
    assert not np.allclose(out, out_pages, rtol=1e-6)
    assert not np.allclose(out, out_heads, rtol=1e-6)


def test_softmax_scale_default(rng):
    q, k_cache, table, seqlens, _ = paged_case(rng, [40], 1, 2, 1, d=72)
    default = reference.mla_decode(q, k_cache, table, seqlens, 64)
    explicit = reference.mla_decode(q, k_cache, table, seqlens, 64, softmax_scale=72 ** -0.5)
    other = reference.mla_decode(q, k_cache, table, seqlens, 64, softmax_scale=0.5)
    np.testing.assert_array_equal(default[1], explicit[1])
    assert not np.allclose(default[1], other[1], rtol=1e-6)


def test_mla_decode_rejects_bad_arguments(rng):
    q, k_cache, table, seqlens, _ = paged_case(rng, [10, 70], 1, 2, 1, d=64)
    with pytest.raises(ValueError, match="cache_seqlens"):
        reference.mla_decode(q, k_cache, table, np.array([10, 64 * table.shape[1] + 1]), 32)
    with pytest.raises(ValueError, match="head_dim_v"):
        reference.mla_decode(q, k_cache, table, seqlens, 65)
    with pytest.raises(ValueError, match="multiple"):
        reference.mla_decode(q[:, :, :1], np.concatenate([k_cache, k_cache], axis=2), table, seqlens, 32)


# --- attention --------------------------------------------------------------------------------

def attention_by_loops(q, k, v, causal, scale):
    """One query row at a time, with Python floats."""
    q, k, v = (reference.to_float64(x) for x in (q, k, v))
    batch, heads, n, _ = q.shape
    out = np.zeros(q.shape[:3] + (v.shape[3],))
    lse = np.zeros(q.shape[:3])
    for b in range(batch):
        for h in range(heads):
            for i in range(n):
                keys = range(i + 1) if causal else range(n)
                scores = [float(q[b, h, i] @ k[b, h, j]) * scale for j in keys]
                m = max(scores)
                lse[b, h, i] = m + math.log(sum(math.exp(s - m) for s in scores))
                for j, s in zip(keys, scores):
                    out[b, h, i] += math.exp(s - lse[b, h, i]) * v[b, h, j]
    return out, lse


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_loops(rng, causal, dtype):
    q, k = (rng.standard_normal((2, 3, 17, 8)).astype(DTYPES[dtype]) for _ in range(2))
    v = rng.standard_normal((2, 3, 17, 5)).astype(DTYPES[dtype])
    out, lse = reference.attention(q, k, v, causal=causal)
    want_out, want_lse = attention_by_loops(q, k, v, causal, 8 ** -0.5)
    assert out.shape == (2, 3, 17, 5) and lse.shape == (2, 3, 17) and out.dtype == np.float64
    np.testing.assert_allclose(out, want_out, **TIGHT)
    np.testing.assert_allclose(lse, want_lse, **TIGHT)
    other_out, _ = reference.attention(q, k, v, causal=not causal)
    assert not np.allclose(other_out, want_out, rtol=1e-6)


def test_attention_scale(rng):
    q, k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(3))
    out, lse = reference.attention(q, k, v, softmax_scale=1.7)
    want_out, want_lse = attention_by_loops(q, k, v, False, 1.7)
    np.testing.assert_allclose(out, want_out, **TIGHT)
    np.testing.assert_allclose(lse, want_lse, **TIGHT)


# --- comparison criteria and conversions --------------------------------------------------------

def test_cos_diff(rng):
    x = rng.standard_normal(10000)
    assert abs(reference.cos_diff(x, x)) < 1e-15
    assert 0.95 < reference.cos_diff(x, rng.standard_normal(10000)) < 1.05   # unrelated
    assert reference.cos_diff(x, -x) == pytest.approx(2.0)
    assert 0 < reference.cos_diff(x, x * (1 + 1e-3 * rng.standard_normal(10000))) < 1e-5
    assert reference.cos_diff(np.zeros(4), np.zeros(4)) == 0.0
    assert reference.cos_diff(x.astype(ml_dtypes.bfloat16), x.astype(ml_dtypes.bfloat16)) < 1e-15


def test_cos_diff_infinities():
    inf, nan = np.inf, np.nan
    assert reference.cos_diff(np.array([1.0, 2.0, inf]), np.array([1.0, 2.0, inf])) < 1e-15
    assert reference.cos_diff(np.array([inf, inf]), np.array([inf, inf])) == 0.0
    assert reference.cos_diff(np.array([1.0, inf]), np.array([1.0, 5.0])) == inf
    assert reference.cos_diff(np.array([1.0, inf]), np.array([1.0, -inf])) == inf
    assert reference.cos_diff(np.array([1.0, nan]), np.array([1.0, nan])) == inf
    with pytest.raises(ValueError, match="shapes"):
        reference.cos_diff(np.zeros(3), np.zeros(4))


def test_max_abs_error():
    inf = np.inf
    assert reference.max_abs_error(np.array([1.0, 2.0, inf]), np.array([1.0, 2.5, inf])) == 0.5
    assert reference.max_abs_error(np.array([1.0, inf]), np.array([1.0, 3.0])) == inf
    assert reference.max_abs_error(np.array([inf]), np.array([inf])) == 0.0
    assert reference.max_abs_error(np.array([-3.0]), np.array([1.0], dtype=np.float16)) == 4.0


def test_to_float64_is_exact_for_every_bfloat16():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    x = bits.view(ml_dtypes.bfloat16)
    with np.errstate(invalid="ignore"):   # casting signaling NaNs sets the invalid flag
        got, want = reference.to_float64(x), x.astype(np.float64)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want)   # NaN positions compare equal here


# --- the same references on CuPy arrays --------------------------------------------------------

@pytest.mark.gpu
def test_cupy_arrays_give_the_numpy_results(rng):
    import cupy

    def on_gpu(x):   # bfloat16 is cast on the device, as tests/mla_inputs.py does
        return cupy.asarray(x.astype(np.float32)).astype(x.dtype)

    q, k_cache, table, seqlens, _ = paged_case(rng, [0, 1, 70, 129], 2, 4, 2, d=576, dtype="bf16")
    want = reference.mla_decode(q, k_cache, table, seqlens, 512, causal=True)
    got = reference.mla_decode(on_gpu(q), on_gpu(k_cache), cupy.asarray(table), cupy.asarray(seqlens), 512,
                               causal=True)
    for g, w in zip(got, want):
        assert isinstance(g, cupy.ndarray)
        np.testing.assert_allclose(cupy.asnumpy(g), w, **TIGHT)

    q, k, v = (rng.standard_normal((2, 3, 9, 8)) for _ in range(3))
    want = reference.attention(q, k, v, causal=True)
    got = reference.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(cupy.asnumpy(g), w, **TIGHT)
    assert reference.cos_diff(cupy.asarray(want[0]), want[0]) < 1e-15


# --- dense FP8 cache and q (one scale per tensor) -----------------------------------------

@pytest.mark.parametrize("fp8_q", [False, True])
def test_fp8_cache_is_the_reference_on_its_dequantized_values(rng, fp8_q):
    """An FP8 cache (and q) with their scales give exactly what the float64 dequantized arrays
    give; the NaN codes in slots no request reads stay out."""
    from flashmla_cupy import quant
    seqlens, s_q, h_q = [70, 1, 0, 130], 2, 16
    q, k_cache, table, _, _ = paged_case(rng, seqlens, s_q, h_q, 1, d=576, page=16, dtype="bf16")
    unread = np.isnan(k_cache.astype(np.float32))
    codes, k_scale = quant.quantize_fp8_per_tensor(np.where(unread, 0, k_cache.astype(np.float32)).astype(k_cache.dtype))
    codes[unread] = 0x7F                                         # a NaN code wherever no request reads
    want_q, q_scale = q, None
    if fp8_q:
        q, q_scale = quant.quantize_fp8_per_tensor(q)
        want_q = quant.dequantize_fp8_per_tensor(q, q_scale, np.float64)
    dequantized = quant.dequantize_fp8_per_tensor(codes, k_scale, np.float64)
    for causal in (False, True):
        out, lse = reference.mla_decode(q, codes, table, np.asarray(seqlens), 512, causal=causal,
                                        k_scale=k_scale, q_scale=q_scale)
        want_out, want_lse = reference.mla_decode(want_q, dequantized, table, np.asarray(seqlens), 512, causal=causal)
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(lse, want_lse)


def test_fp8_scales_are_required_exactly_with_fp8_arrays(rng):
    from flashmla_cupy import quant
    q, k_cache, table, seqlens, _ = paged_case(rng, [5], 1, 2, 1, d=576, dtype="bf16")
    codes, k_scale = quant.quantize_fp8_per_tensor(np.nan_to_num(k_cache.astype(np.float32)).astype(k_cache.dtype))
    with pytest.raises(ValueError, match=r"k_cache holds FP8 codes \(uint8\): k_scale is required"):
        reference.mla_decode(q, codes, table, seqlens)
    with pytest.raises(ValueError, match="k_scale is only for an FP8 k_cache .*bfloat16"):
        reference.mla_decode(q, k_cache, table, seqlens, k_scale=1.0)
    with pytest.raises(ValueError, match=r"q holds FP8 codes \(uint8\): q_scale is required"):
        reference.mla_decode(codes[:1, :1].reshape(1, 1, 1, 576), codes, table, seqlens, k_scale=k_scale)
    with pytest.raises(ValueError, match="q_scale is only for an FP8 q"):
        reference.mla_decode(q, codes, table, seqlens, k_scale=k_scale, q_scale=0.5)
