"""Sparse decoding over DeepSeek-V3.2's FP8 cache (flash_mla_with_kvcache with indices) against
the float64 reference on the dequantized cache, with FlashMLA's tolerances.

Every case: a freshly quantized cache whose unreferenced token rows are NaN bytes, permuted
token ids with skipped entries (-1, past the cache, INT_MIN) and duplicates, outputs poisoned
with NaN before the call, every element checked. Also: scheduler metadata computed for another
topk, or for dense decoding, is reported by the kernel.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import ml_dtypes  # noqa: E402

import flashmla_cupy  # noqa: E402
from flashmla_cupy import quant, reference  # noqa: E402
from flashmla_cupy.testing import METADATA_KIND_ERROR, poisoned  # noqa: E402

pytestmark = pytest.mark.hopper
BF16 = np.dtype(ml_dtypes.bfloat16)
def make_case(rng, b, s_q, h_q, topk, page, num_blocks, invalid=0.1, topk_length=False, sink=False):
    total = num_blocks * page
    ids = rng.integers(0, total, size=(b, s_q, topk)).astype(np.int32)
    bad = rng.random(ids.shape) < invalid
    ids[bad] = rng.choice(np.array([-1, total, total + 7, np.iinfo(np.int32).min, np.iinfo(np.int32).max],
                                   dtype=np.int64), size=int(bad.sum())).astype(np.int32)
    if topk > 3:
        ids[..., 1] = ids[..., 0]                                    # a duplicate
    used = np.unique(ids[(ids >= 0) & (ids < total)])
    kv = (rng.standard_normal((total, 576)) * rng.uniform(0.2, 3.0, size=(total, 1))).astype(BF16)
    packed = np.full((total, 656), 0xFF, dtype=np.uint8)             # 0xFF: NaN in every field
    packed[used] = quant.quantize_fp8_sparse(kv[used])
    cache = packed.reshape(num_blocks, page, 1, 656)
    q = rng.standard_normal((b, s_q, h_q, 576)).astype(BF16)
    lengths = rng.integers(0, topk + 1, size=b).astype(np.int32) if topk_length else None
    if lengths is not None and b > 1:
        lengths[0], lengths[-1] = 0, topk
    attn_sink = rng.uniform(-2, 4, size=h_q).astype(np.float32) if sink else None
    if attn_sink is not None:
        attn_sink[0], attn_sink[-1] = -np.inf, np.inf
    return q, cache, ids, lengths, attn_sink


def largest_v(cache, ids) -> float:
    """max |V| over the tokens that the indices name (0 if none)."""
    tokens = cache.reshape(-1, 656)
    named = np.unique(ids[(ids >= 0) & (ids < len(tokens))])
    if named.size == 0:
        return 0.0
    return float(np.abs(quant.dequantize_fp8_sparse(tokens[named], np.float32)[:, :512]).max())


def run_and_check(case, softmax_scale=None, q_gaps=False):
    """``q_gaps``: q is a view into a NaN-filled array with one more query token and 8 more heads
    (the kernel reads it in place with s_q 1, from a copy in the workspace otherwise)."""
    q, cache, ids, lengths, sink = case
    b, s_q, h_q, _ = q.shape
    dev = [None if x is None else cupy.asarray(x) for x in (q, cache, ids, lengths, sink)]
    if q_gaps:
        wide = np.full((b, s_q + 1, h_q + 8, 576), np.nan, dtype=np.float32).astype(BF16)
        wide[:, :s_q, :h_q] = q
        dev[0] = cupy.asarray(wide)[:, :s_q, :h_q]
    seqlens = cupy.zeros((b,), dtype=np.int32)
    meta, splits = flashmla_cupy.get_mla_metadata(seqlens, s_q * h_q, 1, h_q, True, ids.shape[2])
    out = poisoned((b, s_q, h_q, 512), BF16)
    lse = poisoned((b, h_q, s_q), np.float32)
    flashmla_cupy.flash_mla_with_kvcache(dev[0], dev[1], None, None, 512, meta, splits, softmax_scale,
                                         is_fp8_kvcache=True, indices=dev[2], attn_sink=dev[4],
                                         topk_length=dev[3], out=out, lse=lse)
    flashmla_cupy.check_errors()
    ref_out, ref_lse = reference.mla_decode_sparse(q, cache, ids, softmax_scale, sink, lengths)
    got = reference.to_float64(cupy.asnumpy(out))
    got_lse = cupy.asnumpy(lse).astype(np.float64)
    # FlashMLA's sparse-decoding tolerances (tests/test_flash_mla_sparse_decoding.py). Its cache is
    # clamped to [-1, 1]; ours reaches |V| ~ 13 with sharp attention, where the rounding of P (fp16)
    # for the dominant tokens moves an output by a few 1e-4 |V| (H200, 2026-11-23): the absolute
    # part scales with the largest |V| (a wrong token or page is still off by far more).
    assert np.isfinite(got).all(), "NaN/inf in out"
    err = np.abs(got - ref_out)
    abs_tol = 1e-3 * max(1.0, largest_v(cache, ids))
    assert (err <= abs_tol + 2.01 / 128 * np.abs(ref_out)).all(), f"out: max err {err.max()} (abs tol {abs_tol})"
    assert reference.cos_diff(got, ref_out) < 5e-6
    inf = np.isinf(ref_lse)
    assert (got_lse[inf] == np.inf).all(), "rows without a valid index must have lse = +inf"
    lerr = np.abs(got_lse[~inf] - ref_lse[~inf])
    assert (lerr <= 1e-6 + 8.01 / 65536 * np.abs(ref_lse[~inf])).all(), f"lse: max err {lerr.max() if lerr.size else 0}"


GRID = [  # b, s_q, h_q, topk, page, num_blocks
    (4, 1, 64, 64, 2, 256),
    (4, 3, 128, 64, 2, 256),
    (3, 1, 128, 512, 64, 16),
    (2, 2, 64, 2048, 576, 4),
    (74, 1, 128, 128, 53, 8),
    (5, 2, 16, 200, 1, 700),
    (5, 1, 32, 1000, 61, 20),
    (3, 2, 96, 130, 69, 9),
    (128, 2, 128, 2048, 64, 1024),
]


@pytest.mark.parametrize("b,s_q,h_q,topk,page,num_blocks", GRID)
@pytest.mark.parametrize("options", ["plain", "sink", "topk_length", "both"])
def test_sparse_decoding_matches_reference(b, s_q, h_q, topk, page, num_blocks, options):
    rng = np.random.default_rng([b, s_q, h_q, topk, page, len(options)])
    case = make_case(rng, b, s_q, h_q, topk, page, num_blocks, sink=options in ("sink", "both"),
                     topk_length=options in ("topk_length", "both"))
    run_and_check(case)


def test_all_indices_invalid_gives_zero_and_inf():
    rng = np.random.default_rng(7)
    q, cache, ids, lengths, sink = make_case(rng, 3, 2, 64, 128, 64, 4)
    ids[:] = -1
    ids[1, 0, 5] = 3                                         # one row with a single valid token
    run_and_check((q, cache, ids, lengths, sink))


@pytest.mark.parametrize("s_q", [1, 3])
def test_q_with_gaps_between_heads_tokens_and_requests(s_q):
    rng = np.random.default_rng([13, s_q])
    run_and_check(make_case(rng, 4, s_q, 64, 256, 64, 32, sink=True), q_gaps=True)


def test_softmax_scale_and_large_batch_with_splits():
    rng = np.random.default_rng(11)
    run_and_check(make_case(rng, 2, 2, 128, 8192, 64, 300, invalid=0.3), softmax_scale=0.1)


# --- scheduler metadata of another kind of call ------------------------------------------------

@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("h_q", [64, 128])                  # 128: two m-blocks, a 2-CTA cluster
@pytest.mark.parametrize("kind", ["other-topk", "dense"])
def test_metadata_of_another_kind_is_reported(kind, h_q, mode):
    """Metadata for another topk, or dense metadata of the same shapes, passes the host's shape
    checks; the split-KV kernel compares the topk each row records with indices' last dimension
    and reports the mismatch (at the call in "sync" mode, else by check_errors). A correct call
    afterwards is right."""
    rng = np.random.default_rng([21, h_q])
    b, s_q, topk = 3, 2, 256
    case = make_case(rng, b, s_q, h_q, topk, 64, 16)
    q, cache, ids = (cupy.asarray(x) for x in case[:3])
    if kind == "other-topk":
        meta, splits = flashmla_cupy.get_mla_metadata(cupy.zeros((b,), np.int32), s_q * h_q, 1, h_q, True, 2 * topk)
        want = f"they were computed for sparse decoding with topk={2 * topk}; "
    else:   # a dense batch of b * s_q requests of h_q rows: the same shapes as the sparse call's
        meta, splits = flashmla_cupy.get_mla_metadata(cupy.zeros((b * s_q,), np.int32), h_q, 1)
        assert (meta.shape, splits.shape) == flashmla_cupy.metadata_shapes(b, s_q * h_q, 1, h_q, topk)
        want = "they were computed for dense decoding (no topk); "
    want += f"this sparse call needs topk={topk} (indices' last dimension)"
    message = "^" + re.escape(METADATA_KIND_ERROR + want)
    flashmla_cupy.check_errors()
    with flashmla_cupy.value_checks(mode):
        if mode == "sync":
            with pytest.raises(ValueError, match=message):
                flashmla_cupy.flash_mla_with_kvcache(q, cache, None, None, 512, meta, splits, is_fp8_kvcache=True,
                                                     indices=ids)
        else:
            flashmla_cupy.flash_mla_with_kvcache(q, cache, None, None, 512, meta, splits, is_fp8_kvcache=True,
                                                 indices=ids)
            with pytest.raises(ValueError, match=message):
                flashmla_cupy.check_errors()
    flashmla_cupy.check_errors()                              # reported once, then cleared
    run_and_check(case)
