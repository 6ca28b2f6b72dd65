"""CPU tests of the sparse decoding reference (flashmla_cupy.reference.mla_decode_sparse).

It is checked element by element against ``sparse_by_loops`` (one request, query token and head
at a time, with the upstream formula for the sink) and against cases worked out by hand. In every
case each cache row that no used index points to holds NaN (0xFF bytes in the FP8 cache), so
reading one where it should not shows. Each test has its own fixed seed.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from flashmla_cupy import quant, reference

BF16 = np.dtype(ml_dtypes.bfloat16)
TIGHT = dict(rtol=1e-10, atol=1e-13)   # two float64 computations of the same numbers
INVALID = [-1, -2, -123456, -2**31, 2**31 - 1, 2147480000, 114514]   # and total, total + 1 (per case)


def sparse_by_loops(q, tokens, indices, scale, attn_sink=None, topk_length=None, head_dim_v=512):
    """The attention one (request, query token, head) at a time; tokens: float64 [total, d]."""
    b, s_q, h_q, _ = q.shape
    q = reference.to_float64(q)
    out = np.zeros((b, s_q, h_q, head_dim_v))
    lse = np.full((b, h_q, s_q), np.inf)
    for i in range(b):
        n = indices.shape[2] if topk_length is None else min(max(int(topk_length[i]), 0), indices.shape[2])
        for j in range(s_q):
            used = [int(t) for t in indices[i, j, :n] if 0 <= t < len(tokens)]
            if not used:
                continue
            keys = tokens[used]
            for h in range(h_q):
                scores = keys @ q[i, j, h] * scale
                m = scores.max()
                lse[i, h, j] = m + math.log(np.exp(scores - m).sum())
                out[i, j, h] = np.exp(scores - lse[i, h, j]) @ keys[:, :head_dim_v]
                if attn_sink is not None:          # upstream's ref: out *= 1 / (1 + exp(sink - lse))
                    gap = float(attn_sink[h]) - lse[i, h, j]
                    out[i, j, h] *= 0.0 if gap > 700 else 1.0 / (1.0 + math.exp(gap))
    return out, lse


def used_rows(indices, total, topk_length=None):
    """bool [total]: the cache rows that some used, valid index points to."""
    used = np.zeros(total, bool)
    for i in range(indices.shape[0]):
        n = indices.shape[2] if topk_length is None else min(max(int(topk_length[i]), 0), indices.shape[2])
        idx = indices[i, :, :n].reshape(-1)
        used[idx[(idx >= 0) & (idx < total)]] = True
    return used


def sparse_case(rng, b=3, s_q=2, h_q=8, num_blocks=6, page=64, topk=40, d=576, invalid_share=0.2,
                topk_length=None):
    """q, a bf16 cache (NaN in every row that no used index reads), indices, and the cache's rows
    as float64 [total, d]. Indices are random tokens (repeats possible) with ~invalid_share of
    them out of range; token 0 is never used, so the NaN there would show."""
    total = num_blocks * page
    q = (rng.standard_normal((b, s_q, h_q, d)) / 2).astype(np.float32).astype(BF16)
    cache = (rng.standard_normal((num_blocks, page, 1, d)) / 4 + rng.uniform(-0.1, 0.1)).astype(np.float32)
    indices = rng.integers(1, total, (b, s_q, topk))
    bad = rng.random((b, s_q, topk)) < invalid_share
    indices[bad] = rng.choice(INVALID + [total, total + 1], int(bad.sum()))
    indices = indices.astype(np.int32)
    rows = cache.reshape(total, d)
    rows[~used_rows(indices, total, topk_length)] = np.nan
    cache = cache.astype(BF16)
    return q, cache, indices, reference.to_float64(cache).reshape(total, d)


def random_sink(rng, h_q):
    sink = rng.standard_normal(h_q).astype(np.float32)
    sink[:2] = [-np.inf, np.inf]
    return sink


def assert_matches_loops(q, cache, tokens, indices, **kwargs):
    out, lse = reference.mla_decode_sparse(q, cache, indices, **kwargs)
    scale = kwargs.get("softmax_scale") or q.shape[3] ** -0.5
    want_out, want_lse = sparse_by_loops(q, tokens, indices, scale, kwargs.get("attn_sink"),
                                         kwargs.get("topk_length"), kwargs.get("head_dim_v", 512))
    assert out.dtype == lse.dtype == np.float64
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    np.testing.assert_allclose(out, want_out, **TIGHT)
    np.testing.assert_allclose(lse, want_lse, **TIGHT)
    assert np.isfinite(out).all() and not np.isnan(lse).any()      # no NaN row leaked in
    return out, lse


# --------------------------------------------------------------------------------------------
# Against the loops
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", [1, 2, 53, 64, 576])
def test_matches_loops(page):
    rng = np.random.default_rng(200 + page)
    num_blocks = max(600 // page, 2)
    q, cache, indices, tokens = sparse_case(rng, num_blocks=num_blocks, page=page)
    out, lse = assert_matches_loops(q, cache, tokens, indices)
    assert np.isfinite(lse).all() and (out != 0).any()

    topk_length = np.array([0, 17, 1000], np.int32)                    # none, part, clamped to topk
    q, cache, indices, tokens = sparse_case(rng, num_blocks=num_blocks, page=page, topk_length=topk_length)
    out, lse = assert_matches_loops(q, cache, tokens, indices, attn_sink=random_sink(rng, 8),
                                    topk_length=topk_length, softmax_scale=0.3)
    assert (out[0] == 0).all() and np.isposinf(lse[0]).all()


def test_other_head_dims_and_many_query_tokens():
    rng = np.random.default_rng(210)
    q, cache, indices, tokens = sparse_case(rng, b=2, s_q=5, h_q=3, num_blocks=4, page=16, topk=9, d=40)
    assert_matches_loops(q, cache, tokens, indices, head_dim_v=24, softmax_scale=0.7)


def test_by_hand_with_a_duplicate_index():
    """Keys [1, 0] (token 3) and [0, 1] (token 4), q = [1, 0], V = first column, scale 1.

    Indices [3, 3, 4]: scores 1, 1, 0, so out = 2e / (2e + 1) and lse = log(2e + 1); [3, 4, -1]
    counts token 3 once: e / (e + 1) and log(e + 1).
    """
    cache = np.zeros((3, 2, 1, 2))
    cache.reshape(6, 2)[3] = [1.0, 0.0]
    cache.reshape(6, 2)[4] = [0.0, 1.0]
    q = np.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    e = math.e
    out, lse = reference.mla_decode_sparse(q, cache, np.array([[[3, 3, 4]]]), softmax_scale=1.0, head_dim_v=1)
    assert out[0, 0, 0, 0] == pytest.approx(2 * e / (2 * e + 1), rel=1e-15)
    assert lse[0, 0, 0] == pytest.approx(math.log(2 * e + 1), rel=1e-15)
    out, lse = reference.mla_decode_sparse(q, cache, np.array([[[3, 4, -1]]]), softmax_scale=1.0, head_dim_v=1)
    assert out[0, 0, 0, 0] == pytest.approx(e / (e + 1), rel=1e-15)
    assert lse[0, 0, 0] == pytest.approx(math.log(e + 1), rel=1e-15)


# --------------------------------------------------------------------------------------------
# Indices, lengths and the sink, one at a time
# --------------------------------------------------------------------------------------------

def test_invalid_indices_are_skipped():
    """Any out-of-range value gives exactly what -1 gives; rows of only invalid ones are empty."""
    rng = np.random.default_rng(220)
    q, cache, indices, tokens = sparse_case(rng, invalid_share=0.5)
    total = len(tokens)
    indices[0, 1, :] = rng.choice(INVALID + [total, total + 1], indices.shape[2])   # one row: none valid
    as_minus_one = np.where((indices >= 0) & (indices < total), indices, -1).astype(np.int32)
    out, lse = assert_matches_loops(q, cache, tokens, indices)
    for got, want in zip((out, lse), reference.mla_decode_sparse(q, cache, as_minus_one)):
        np.testing.assert_array_equal(got, want)
    assert (out[0, 1] == 0).all() and np.isposinf(lse[0, :, 1]).all()
    assert np.isfinite(lse[1:]).all() and np.isfinite(lse[0, :, 0]).all()


def test_all_invalid_requests_give_zero_and_inf_even_with_a_sink():
    rng = np.random.default_rng(221)
    q, cache, indices, tokens = sparse_case(rng)
    indices[1] = -1
    indices[2] = 2**31 - 1
    out, lse = assert_matches_loops(q, cache, tokens, indices, attn_sink=random_sink(rng, 8))
    assert (out[1:] == 0).all() and np.isposinf(lse[1:]).all()
    assert np.isfinite(lse[0]).all()


def test_topk_length():
    """Request i reads indices[i, :, :n] only: past n an index may be anything, or point at NaN."""
    rng = np.random.default_rng(222)
    lengths = np.array([0, 11, 40], np.int32)
    q, cache, indices, tokens = sparse_case(rng, invalid_share=0.0, topk_length=lengths)
    indices[1, 0, 11:] = 2**31 - 1
    indices[1, 1, 11:] = 0                   # token 0 holds NaN
    out, lse = assert_matches_loops(q, cache, tokens, indices, topk_length=lengths)
    assert (out[0] == 0).all() and np.isposinf(lse[0]).all()
    for i in (1, 2):                         # the same as indices cut to the length
        cut = reference.mla_decode_sparse(q[i:i + 1], cache, indices[i:i + 1, :, :lengths[i]])
        np.testing.assert_allclose(out[i:i + 1], cut[0], **TIGHT)
        np.testing.assert_allclose(lse[i:i + 1], cut[1], **TIGHT)
    # beyond topk and below 0: clamped
    full = reference.mla_decode_sparse(q[2:], cache, indices[2:])
    for length in (40, 41, 2**31 - 1):
        got = reference.mla_decode_sparse(q[2:], cache, indices[2:], topk_length=np.array([length], np.int32))
        for g, w in zip(got, full):
            np.testing.assert_array_equal(g, w)
    out, lse = reference.mla_decode_sparse(q[2:], cache, indices[2:], topk_length=np.array([-5], np.int32))
    assert (out == 0).all() and np.isposinf(lse).all()


def test_attn_sink():
    rng = np.random.default_rng(223)
    q, cache, indices, tokens = sparse_case(rng, h_q=4)
    plain_out, plain_lse = reference.mla_decode_sparse(q, cache, indices)

    out, lse = reference.mla_decode_sparse(q, cache, indices, attn_sink=np.full(4, -np.inf, np.float32))
    np.testing.assert_array_equal(out, plain_out)                     # -inf: no effect at all
    np.testing.assert_array_equal(lse, plain_lse)

    out, lse = reference.mla_decode_sparse(q, cache, indices, attn_sink=np.full(4, np.inf, np.float32))
    assert (out == 0).all()                                           # +inf: all weight on the sink
    np.testing.assert_array_equal(lse, plain_lse)

    sink = np.array([-1.5, 0.0, 2.0, 30.0], np.float32)
    out, lse = reference.mla_decode_sparse(q, cache, indices, attn_sink=sink)
    np.testing.assert_array_equal(lse, plain_lse)                     # lse is not changed by the sink
    factor = 1 / (1 + np.exp(sink.astype(np.float64)[None, :, None] - plain_lse))   # [b, h_q, s_q]
    np.testing.assert_allclose(out, plain_out * factor.transpose(0, 2, 1)[..., None], **TIGHT)
    assert (out != plain_out).all()


def test_nan_in_unread_rows_changes_nothing():
    """Replacing every NaN row of the cache with finite values changes no bit of the result."""
    rng = np.random.default_rng(224)
    lengths = np.array([5, 40, 23], np.int32)
    q, cache, indices, _ = sparse_case(rng, topk_length=lengths)
    sink = random_sink(rng, 8)
    out, lse = reference.mla_decode_sparse(q, cache, indices, attn_sink=sink, topk_length=lengths)
    clean = cache.astype(np.float32)
    unread = np.isnan(clean)
    assert unread[0, 0].all() and unread.mean() > 0.5                 # token 0, and most rows, poisoned
    clean[unread] = rng.uniform(-1e3, 1e3, int(unread.sum()))
    clean_out, clean_lse = reference.mla_decode_sparse(q, clean.astype(BF16), indices, attn_sink=sink,
                                                       topk_length=lengths)
    np.testing.assert_array_equal(out, clean_out)
    np.testing.assert_array_equal(lse, clean_lse)


def test_permuted_pages_give_the_same_result():
    """Tokens in pages in order, or the same pages shuffled with the indices following them."""
    rng = np.random.default_rng(225)
    page, num_blocks = 53, 7
    q, cache, indices, _ = sparse_case(rng, num_blocks=num_blocks, page=page)
    where = rng.permutation(num_blocks)                      # logical page p lives in block where[p]
    shuffled = np.empty_like(cache)
    shuffled[where] = cache
    valid = (indices >= 0) & (indices < num_blocks * page)
    moved = np.where(valid, where[indices // page % num_blocks] * page + indices % page, indices).astype(np.int32)
    got = reference.mla_decode_sparse(q, shuffled, moved)
    for g, w in zip(got, reference.mla_decode_sparse(q, cache, indices)):
        np.testing.assert_array_equal(g, w)


# --------------------------------------------------------------------------------------------
# The FP8 cache
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", [2, 64])
def test_fp8_cache_equals_its_dequantized_float_cache(page):
    rng = np.random.default_rng(230 + page)
    lengths = np.array([40, 7, 33], np.int32)
    q, cache, indices, _ = sparse_case(rng, num_blocks=640 // page, page=page, topk_length=lengths)
    unread = np.isnan(cache.astype(np.float32)).all(axis=-1)
    packed = quant.quantize_fp8_sparse(np.where(unread[..., None], cache.dtype.type(0.5), cache))
    packed[unread] = 0xFF                                     # NaN codes, NaN scales, NaN RoPE
    kwargs = dict(attn_sink=random_sink(rng, 8), topk_length=lengths)

    out, lse = reference.mla_decode_sparse(q, packed, indices, **kwargs)
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    for dtype in (np.float32, np.float64, ml_dtypes.bfloat16):
        dense = quant.dequantize_fp8_sparse(packed, dtype)
        for g, w in zip((out, lse), reference.mla_decode_sparse(q, dense, indices, **kwargs)):
            np.testing.assert_array_equal(g, w)
    for view in (np.int8, ml_dtypes.float8_e4m3fn):
        for g, w in zip((out, lse), reference.mla_decode_sparse(q, packed.view(view), indices, **kwargs)):
            np.testing.assert_array_equal(g, w)
    # and the quantization is close to the bf16 cache it came from
    bf16_out, _ = reference.mla_decode_sparse(q, cache, indices, **kwargs)
    assert reference.cos_diff(out, bf16_out) < 1e-3


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

def test_softmax_scale_default():
    rng = np.random.default_rng(240)
    q, cache, indices, _ = sparse_case(rng, b=1, h_q=2)
    default = reference.mla_decode_sparse(q, cache, indices)
    explicit = reference.mla_decode_sparse(q, cache, indices, softmax_scale=576 ** -0.5)
    other = reference.mla_decode_sparse(q, cache, indices, softmax_scale=0.5)
    np.testing.assert_array_equal(default[1], explicit[1])
    assert not np.allclose(default[1], other[1], rtol=1e-6)


def test_bad_arguments():
    rng = np.random.default_rng(241)
    q, cache, indices, _ = sparse_case(rng, b=2, s_q=1, h_q=4, topk=5)
    packed = quant.quantize_fp8_sparse(np.nan_to_num(cache.astype(np.float32)).astype(BF16))
    cases = [
        (ValueError, "q must be", dict(q=q[0])),
        (ValueError, "one KV head", dict(k_cache=np.concatenate([cache, cache], axis=2))),
        (ValueError, "head dims differ", dict(k_cache=cache[..., :575])),
        (ValueError, "FP8 k_cache .* 656", dict(k_cache=packed[..., :655])),
        (ValueError, r"FP8 k_cache .* q \[b, s_q, h_q, 576\]", dict(q=q[..., :64], k_cache=packed)),
        (ValueError, "head_dim_v", dict(head_dim_v=0)),
        (ValueError, "head_dim_v", dict(head_dim_v=577)),
        (ValueError, r"indices must be \[2, 1, topk\]", dict(indices=indices[:1])),
        (ValueError, r"indices must be \[2, 1, topk\]", dict(indices=indices[..., 0])),
        (TypeError, "indices must be integers", dict(indices=indices.astype(np.float32))),
        (ValueError, r"topk_length must be \[2\]", dict(topk_length=np.array([1, 2, 3], np.int32))),
        (TypeError, "topk_length must be integers", dict(topk_length=np.array([1.0, 2.0]))),
        (ValueError, r"attn_sink must be \[4\]", dict(attn_sink=np.zeros(3, np.float32))),
    ]
    for error, words, change in cases:
        args = dict(q=q, k_cache=cache, indices=indices) | change
        with pytest.raises(error, match=words):
            reference.mla_decode_sparse(**args)


# --------------------------------------------------------------------------------------------
# CuPy arrays
# --------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cupy_arrays_give_the_numpy_results():
    import cupy

    def on_gpu(x):
        return cupy.asarray(x.view(np.uint16)).view(x.dtype) if x.dtype == BF16 else cupy.asarray(x)

    rng = np.random.default_rng(250)
    lengths = np.array([40, 0, 13], np.int32)
    q, cache, indices, _ = sparse_case(rng, page=53, topk_length=lengths)
    kwargs = dict(attn_sink=random_sink(rng, 8), topk_length=lengths)
    packed = quant.quantize_fp8_sparse(np.nan_to_num(cache.astype(np.float32)).astype(BF16))
    for k_cache in (cache, packed):
        want = reference.mla_decode_sparse(q, k_cache, indices, **kwargs)
        got = reference.mla_decode_sparse(on_gpu(q), on_gpu(k_cache), cupy.asarray(indices),
                                          attn_sink=cupy.asarray(kwargs["attn_sink"]), topk_length=lengths)
        for g, w in zip(got, want):
            assert isinstance(g, cupy.ndarray)
            np.testing.assert_allclose(cupy.asnumpy(g), w, **TIGHT)
