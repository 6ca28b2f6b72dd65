"""The profiler and its command line, on the CPU.

Pure parts (statistics, cost model, bound classification, seqlen draws, exports) are tested
directly; the profile loop runs end to end on NumPy arrays through a stand-in for the CUDA session
(the real input builder, the plain MLA baseline and the float64 reference all work on NumPy), so
the table, CSV, JSON and plot are produced exactly as on a GPU. The GPU-only paths are at the end,
marked ``gpu`` / ``hopper``.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
import random
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from flashmla_cupy import baselines, cli, quant, reference
from flashmla_cupy.profiler import (anchors, build, ceilings, clocks, env, inputs, report, runner, shapes, targets,
                                    timing)

BF16 = np.dtype(ml_dtypes.bfloat16)

# anchors-h100.md, first row and last full-grid row, with the ceilings measured in that run.
ANCHOR_COPY_GBPS, ANCHOR_MATMUL_TFLOPS = 3019.0, 686.0


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------

def test_summarize_matches_numpy_percentiles():
    samples = [7.0, 1.0, 10.0, 3.0, 5.0, 2.0, 9.0, 4.0, 8.0, 6.0]
    s = timing.summarize(samples)
    assert s.n == 10 and s.min == 1.0 and s.max == 10.0
    assert s.median == pytest.approx(5.5)
    assert s.p10 == pytest.approx(1.9) and s.p90 == pytest.approx(9.1)
    assert s.q1 == pytest.approx(3.25) and s.q3 == pytest.approx(7.75)
    assert s.iqr == pytest.approx(4.5)
    assert s.mean == pytest.approx(5.5) and s.std == pytest.approx(np.std(samples))
    for q, got in ((10, s.p10), (25, s.q1), (50, s.median), (75, s.q3), (90, s.p90)):
        assert got == pytest.approx(np.percentile(samples, q))
    assert s.spread_pct == pytest.approx(50 * (9.1 - 1.9) / 5.5)


def test_summarize_edge_cases():
    one = timing.summarize([0.25])
    assert one.median == one.p10 == one.p90 == one.min == one.max == 0.25 and one.std == 0
    with pytest.raises(ValueError):
        timing.summarize([])
    with pytest.raises(ValueError):
        timing.percentile([1.0], 101)
    d = timing.summarize([1.0, 2.0, 3.0]).as_dict()
    assert d["ms_median"] == 2.0 and d["n_runs"] == 3 and "ms_n" not in d


def test_runs_for_budget():
    assert timing.runs_for_budget(0.3, 100, 3.0) == 100          # fast: all repeats
    assert timing.runs_for_budget(100.0, 100, 3.0) == 30         # slow: what fits in the budget
    assert timing.runs_for_budget(1000.0, 100, 3.0) == 10        # never fewer than 10
    assert timing.runs_for_budget(1000.0, 5, 3.0) == 5           # nor more than asked


# --------------------------------------------------------------------------------------------
# Cost model and bound
# --------------------------------------------------------------------------------------------

def _fixed(b, s, h_q, s_q, h_kv=1, dtype="bf16", q_dtype=None):
    return shapes.MLAShape(b, s, h_q, s_q, False, (s,) * b, h_kv=h_kv, dtype=dtype, q_dtype=q_dtype)


def test_flops_and_bytes_by_hand():
    s = _fixed(128, 4096, 16, 1)
    assert shapes.mla_flops(s) == 2 * 1 * (128 * 4096) * 16 * (576 + 512) == 18_253_611_008
    assert shapes.mla_bytes(s) == 2 * (128 * 4096 * 1 * 576 + 128 * 1 * 16 * 576 + 128 * 1 * 16 * 512) \
        == 608_436_224
    s2 = _fixed(2, 100, 8, 2, h_kv=2, dtype="fp16")
    assert shapes.mla_flops(s2) == 2 * 2 * 200 * 8 * 1088
    assert shapes.mla_bytes(s2) == 2 * (200 * 2 * 576 + 2 * 2 * 8 * 576 + 2 * 2 * 8 * 512)
    a = shapes.AttentionShape(16, 12, 64, 64)
    assert shapes.attention_flops(a) == 4 * 16 * 12 * 64 * 64 * 64
    assert shapes.attention_flops(shapes.AttentionShape(16, 12, 64, 64, causal=True)) == 2 * 16 * 12 * 64 * 64 * 64
    assert shapes.attention_bytes(a) == 4 * 4 * 16 * 12 * 64 * 64


def test_fp8_cache_is_counted_at_one_byte_an_element():
    """A token of the FP8 cache is 576 bytes, of a 16-bit one 1152; q and out stay bf16 (2 bytes);
    the FLOPs do not change."""
    bf16, fp8 = _fixed(128, 4096, 16, 1), _fixed(128, 4096, 16, 1, dtype="fp8")
    one_more_token = {d: dataclasses.replace(_fixed(128, 4096, 16, 1, dtype=d), seqlens=(4097,) + (4096,) * 127)
                      for d in ("bf16", "fp16", "fp8")}
    assert shapes.mla_bytes(one_more_token["fp8"]) - shapes.mla_bytes(fp8) == 576
    assert shapes.mla_bytes(one_more_token["bf16"]) - shapes.mla_bytes(bf16) == 1152
    assert shapes.mla_bytes(one_more_token["fp16"]) - shapes.mla_bytes(_fixed(128, 4096, 16, 1, dtype="fp16")) == 1152
    q_and_out = 2 * (128 * 1 * 16 * 576 + 128 * 1 * 16 * 512)
    assert shapes.mla_bytes(fp8) == 576 * 128 * 4096 + q_and_out == 306_446_336
    assert shapes.mla_bytes(bf16) == 1152 * 128 * 4096 + q_and_out == 608_436_224
    assert shapes.mla_flops(fp8) == shapes.mla_flops(bf16)
    assert [s.q_dtype for s in (bf16, fp8, one_more_token["fp16"])] == ["bf16", "bf16", "fp16"]


def test_e4m3_q_is_counted_at_one_byte_an_element():
    """An e4m3 q over the FP8 cache: q read at 1 byte an element, out still written in bf16 (2
    bytes), the cache still 576 bytes a token; the FLOPs do not change."""
    bf16_q, e4m3_q = _fixed(128, 4096, 16, 2, dtype="fp8"), _fixed(128, 4096, 16, 2, dtype="fp8", q_dtype="fp8")
    q_elements = 128 * 2 * 16 * 576
    assert shapes.mla_bytes(bf16_q) - shapes.mla_bytes(e4m3_q) == q_elements
    assert shapes.mla_bytes(e4m3_q) == 576 * 128 * 4096 + 1 * q_elements + 2 * 128 * 2 * 16 * 512 == 308_543_488
    one_more_token = dataclasses.replace(e4m3_q, seqlens=(4097,) + (4096,) * 127)
    assert shapes.mla_bytes(one_more_token) - shapes.mla_bytes(e4m3_q) == 576
    assert shapes.mla_flops(e4m3_q) == shapes.mla_flops(bf16_q)


def test_q_dtype_is_the_caches_unless_the_fp8_cache_is_read_by_an_e4m3_q():
    """q's dtype is a field of the shape: by default the 16-bit cache's own, bf16 over the FP8
    cache; an e4m3 q ("fp8") reads the FP8 cache only. It is in every row (``as_dict``)."""
    assert [shapes.q_dtypes(d) for d in ("bf16", "fp16", "fp8")] == [("bf16",), ("fp16",), ("bf16", "fp8")]
    assert [shapes.out_dtype(d) for d in ("bf16", "fp16", "fp8")] == ["bf16", "fp16", "bf16"]
    assert [_fixed(2, 64, 16, 1, dtype=d).q_dtype for d in ("bf16", "fp16", "fp8")] == ["bf16", "fp16", "bf16"]
    e4m3_q = _fixed(2, 64, 16, 1, dtype="fp8", q_dtype="fp8")
    assert e4m3_q.as_dict()["q_dtype"] == "fp8" and e4m3_q.as_dict()["dtype"] == "fp8"
    assert e4m3_q != _fixed(2, 64, 16, 1, dtype="fp8") and _fixed(2, 64, 16, 1, dtype="fp8", q_dtype="bf16") == \
        _fixed(2, 64, 16, 1, dtype="fp8")
    for dtype, q in (("bf16", "fp8"), ("fp16", "bf16"), ("bf16", "fp16"), ("fp8", "fp16")):
        with pytest.raises(ValueError, match=f"q_dtype '{q}' does not read a {dtype} cache"):
            _fixed(2, 64, 16, 1, dtype=dtype, q_dtype=q)
    grid = shapes.mla_grid(batches=(2,), seqlens=(100,), heads=(16,), dtype="fp8", q_dtype="fp8")
    assert len(grid) == 4 and {(s.dtype, s.q_dtype) for s in grid} == {("fp8", "fp8")}
    assert [s.seqlens for s in grid] == [s.seqlens for s in shapes.mla_grid(batches=(2,), seqlens=(100,),
                                                                            heads=(16,), dtype="fp8")]
    assert {s.q_dtype for s in shapes.quick_grid(dtype="fp8", q_dtype="fp8")} == {"fp8"}
    with pytest.raises(ValueError, match="does not read a bf16 cache"):
        shapes.quick_grid(q_dtype="fp8")


@pytest.mark.parametrize("row", [
    # (b, s_k, h_q, s_q, GB/s, TFLOP/s, GB/s / copy, TFLOP/s / matmul, bound) from anchors-h100.md
    (128, 4096, 16, 1, 2399, 72, 0.79, 0.10, "memory"),
    (128, 8192, 64, 1, 2543, 303, 0.84, 0.44, "memory"),
    (128, 16384, 128, 2, 938, 441, 0.31, 0.64, "compute"),
])
def test_rates_match_the_anchor_rows(row):
    b, s, h_q, s_q, gbps, tflops, fb, ff, bound = row
    shape = _fixed(b, s, h_q, s_q)
    ms = shapes.mla_bytes(shape) / (gbps * 1e9) * 1e3       # the anchor's time, unrounded
    c = ceilings.Ceilings(ANCHOR_COPY_GBPS, ANCHOR_MATMUL_TFLOPS)
    rates = runner._rate_fields(ms, shapes.mla_flops(shape), shapes.mla_bytes(shape), c)
    assert rates["gbps"] == pytest.approx(gbps) and rates["bw"] == rates["gbps"]
    assert rates["tflops"] == pytest.approx(tflops, abs=1.0)
    assert rates["frac_copy_bw"] == pytest.approx(fb, abs=0.006)
    assert rates["frac_matmul"] == pytest.approx(ff, abs=0.006)
    assert rates["bound"] == bound
    assert rates["roof_fraction"] == pytest.approx(max(fb, ff), abs=0.006)


def test_classify():
    c = ceilings.Ceilings(copy_gbps=1000.0, matmul_tflops=100.0)
    # 1e9 bytes need 1 ms at 1000 GB/s; 1e10 FLOPs need 0.1 ms at 100 TFLOP/s
    b = ceilings.classify(2.0, 1e10, 1e9, c)
    assert b.kind == "memory" and b.t_memory_ms == pytest.approx(1.0) and b.t_compute_ms == pytest.approx(0.1)
    assert b.roof_fraction == pytest.approx(0.5)
    b = ceilings.classify(4.0, 2e11, 1e9, c)
    assert b.kind == "compute" and b.roof_fraction == pytest.approx(0.5)
    assert ceilings.classify(1.0, 1e9, 1e9, ceilings.Ceilings()).kind == "?"
    only_copy = ceilings.classify(1.0, 1e12, 1e9, ceilings.Ceilings(copy_gbps=1000.0))
    assert only_copy.kind == "memory" and only_copy.t_compute_ms is None
    assert ceilings.fractions(500.0, 50.0, c) == (0.5, 0.5)
    assert ceilings.fractions(500.0, 50.0, ceilings.Ceilings()) == (None, None)


# --------------------------------------------------------------------------------------------
# Shapes and seqlen draws
# --------------------------------------------------------------------------------------------

def test_default_grid_is_the_seed_tests_grid_with_its_draws():
    grid = shapes.mla_grid()
    assert len(grid) == 48
    # The seed's test: random.seed(0), then its loops in this order, one normalvariate per request.
    random.seed(0)
    expected = []
    for s in (4096, 8192, 16384):
        for h_q in (16, 32, 64, 128):
            for s_q in (1, 2):
                for varlen in (False, True):
                    lens = [s] * 128
                    if varlen:
                        lens = [int(max(random.normalvariate(s, s / 2), s_q)) for _ in range(128)]
                    expected.append((128, s, h_q, s_q, varlen, tuple(lens)))
    assert [(g.batch, g.mean_seqlen, g.h_q, g.s_q, g.varlen, g.seqlens) for g in grid] == expected
    assert all(g.causal and g.h_kv == 1 and g.dtype == "bf16" for g in grid)


def test_draws_respect_s_q_and_seed():
    rng = random.Random(3)
    lens = shapes.draw_seqlens(rng, 1000, 8, 4, True)
    assert min(lens) >= 4 and all(isinstance(x, int) for x in lens)
    assert shapes.mla_grid(seed=1)[1].seqlens != shapes.mla_grid(seed=0)[1].seqlens
    with pytest.raises(ValueError):
        shapes.mla_grid(heads=(16,), h_kv=3)


def test_quick_grid_takes_its_shapes_from_the_full_grid():
    full = {s.key: s for s in shapes.mla_grid()}
    quick = shapes.quick_grid()
    assert 2 <= len(quick) <= 6
    for q in quick:
        assert full[q.key].seqlens == q.seqlens


def test_shape_geometry():
    s = shapes.MLAShape(2, 300, 16, 1, True, (300, 513))
    assert s.total_seqlen == 813 and s.max_seqlen == 513 and s.max_seqlen_pad == 768
    assert s.num_blocks == 2 * 768 // 64 and s.seqlen_mean == 406.5
    assert "s_k=300~" in s.label() and "page" not in s.label() and s.page_size == 64


@pytest.mark.parametrize("page, pad", [(1, 768), (16, 768), (256, 768), (512, 1024), (1024, 1024)])
def test_page_size_changes_the_layout_not_the_cost(page, pad):
    """Pages up to 256 tokens keep the seed's padding to 256; larger ones pad to a whole page.
    FLOPs and bytes count tokens: the same at every page size."""
    seed_layout = shapes.MLAShape(2, 300, 16, 1, True, (300, 513))
    s = dataclasses.replace(seed_layout, page_size=page)
    assert s.max_seqlen_pad == pad and s.num_blocks == 2 * pad // page
    assert s.label() == f"b=2 s_k=300~ h_q=16 s_q=1 page={page}" and s.as_dict()["page_size"] == page
    assert shapes.mla_flops(s) == shapes.mla_flops(seed_layout)
    assert shapes.mla_bytes(s) == shapes.mla_bytes(seed_layout)


def test_page_sizes_cross_the_grid_with_the_same_draws():
    grid = shapes.mla_grid(batches=(2,), seqlens=(100, 200), heads=(16,), s_qs=(1, 2), varlens=(False, True),
                           page_sizes=(16, 64, 512))
    seed_pages = _small_grid()
    assert len(grid) == 3 * len(seed_pages)
    assert [s.page_size for s in grid] == [16, 64, 512] * len(seed_pages)
    for i, one in enumerate(seed_pages):            # each shape's rows, adjacent, with its draws
        assert [dataclasses.replace(s, page_size=64) for s in grid[3 * i:3 * i + 3]] == [one] * 3
    quick = shapes.quick_grid(page_sizes=(1, 128))
    assert [(s.key, s.page_size) for s in quick] == [(k, p) for k in shapes.QUICK_KEYS for p in (1, 128)]
    assert [s.seqlens for s in quick[::2]] == [s.seqlens for s in shapes.quick_grid()]
    for bad in (0, 3, 48):
        with pytest.raises(ValueError, match=f"page size {bad} is not a power of two"):
            shapes.mla_grid(page_sizes=(64, bad))


# --------------------------------------------------------------------------------------------
# The plain CuPy baseline (run on NumPy) against the float64 reference
# --------------------------------------------------------------------------------------------

def _random_case(b, s_q, h_q, h_kv, mean, dtype, seed=0, permute=True):
    rng = np.random.default_rng(seed)
    seqlens = np.maximum(rng.normal(mean, mean / 2, b), s_q).astype(np.int32)
    pages = -(-seqlens // 64)
    width = int(pages.max()) + 1
    num_blocks = int(pages.sum()) + 2
    ids = rng.permutation(num_blocks) if permute else np.arange(num_blocks)
    table = np.full((b, width), 10**6, dtype=np.int32)            # garbage past each request's pages
    k = rng.standard_normal((num_blocks, 64, h_kv, 576)).astype(np.float32)
    k[:] = np.nan
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = ids[start:start + n]
        for j in range(n):
            valid = min(64, int(seqlens[i]) - 64 * j)
            k[ids[start + j], :valid] = rng.standard_normal((valid, h_kv, 576))
        start += n
    q = rng.standard_normal((b, s_q, h_q, 576)).astype(np.float32)
    return (baselines.from_float32(q, dtype), baselines.from_float32(k, dtype), table, seqlens)


@pytest.mark.parametrize("b,s_q,h_q,h_kv,mean,dtype,causal,workspace", [
    (3, 1, 16, 1, 100, BF16, True, 1 << 30),
    (4, 2, 8, 2, 150, np.float16, True, 1 << 20),      # several chunks
    (5, 2, 4, 1, 70, BF16, False, 1),                  # one request per chunk
])
def test_baseline_matches_float64_reference(b, s_q, h_q, h_kv, mean, dtype, causal, workspace):
    q, k, table, seqlens = _random_case(b, s_q, h_q, h_kv, mean, dtype)
    ref_out, ref_lse = reference.mla_decode(q, k, table, seqlens, 512, causal=causal)
    out, lse = baselines.mla_decode(q, k, table, seqlens, 512, causal=causal, workspace_bytes=workspace)
    assert out.dtype == np.dtype(dtype) and out.shape == (b, s_q, h_q, 512)
    assert lse.dtype == np.float32 and lse.shape == (b, h_q, s_q)
    assert reference.cos_diff(out, ref_out) < 1e-5
    assert reference.cos_diff(lse, ref_lse) < 1e-5
    assert reference.max_abs_error(lse, ref_lse) < 1e-3
    out64, lse64 = baselines.mla_decode(q, k, table, seqlens, 512, causal=causal,
                                        compute_dtype=np.float64, workspace_bytes=workspace)
    assert out64.dtype == np.float64
    assert reference.max_abs_error(out64, ref_out) < 1e-10
    assert reference.max_abs_error(lse64, ref_lse) < 1e-10


def test_baseline_rejects_bad_arguments():
    q, k, table, seqlens = _random_case(2, 2, 4, 1, 50, BF16)
    with pytest.raises(ValueError):
        baselines.PagedMLA(table, np.array([1, 1]), s_q=2, h_q=4, h_kv=1, page_block=64, causal=True)
    with pytest.raises(ValueError):
        baselines.PagedMLA(table, seqlens, s_q=2, h_q=4, h_kv=3, page_block=64)
    plan = baselines.PagedMLA(table, seqlens, s_q=2, h_q=4, h_kv=1, page_block=64)
    with pytest.raises(ValueError):
        plan(q[:, :1], k)


def test_bf16_conversions_round_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf, np.nan, 3.0e38], dtype=np.float32)
    got = baselines.from_float32(x, BF16)
    want = x.astype(BF16)
    assert (got.view(np.uint16)[:5] == want.view(np.uint16)[:5]).all()
    assert np.isnan(baselines.to_compute(got)[5])
    back = baselines.to_compute(got)
    assert back.dtype == np.float32 and back[0] == 1.0 and back[3] == -2.5


def test_seed_layout_inputs_on_numpy():
    shape = shapes.MLAShape(3, 100, 4, 2, True, (70, 130, 2))
    inp = inputs.make_mla_inputs(shape, seed=5, xp=np)
    assert inp.q.shape == (3, 2, 4, 576) and inp.q.dtype == BF16
    assert inp.k_cache.shape == (shape.num_blocks, 64, 1, 576)
    assert (inp.block_table == np.arange(shape.num_blocks).reshape(3, -1)).all()
    per_request = baselines.to_compute(inp.k_cache).reshape(3, shape.max_seqlen_pad, 1, 576)
    for i, n in enumerate(shape.seqlens):
        assert np.isfinite(per_request[i, :n]).all() and np.isnan(per_request[i, n:]).all()
    again = inputs.make_mla_inputs(shape, seed=5, xp=np)
    assert (again.q.view(np.uint16) == inp.q.view(np.uint16)).all()


@pytest.mark.parametrize("page", [1, 16, 128, 512])
def test_inputs_in_pages_of_any_size_hold_the_seed_layouts_tokens(page):
    """Pages of ``page`` tokens: a request's tokens are the ones it has in 64-token pages (the
    padded length is 512 either way), so the float64 reference and the plain CuPy target read the
    same problem."""
    seed_layout = shapes.MLAShape(3, 100, 4, 2, True, (70, 300, 2))
    shape = dataclasses.replace(seed_layout, page_size=page)
    inp = inputs.make_mla_inputs(shape, seed=5, xp=np)
    seed_inp = inputs.make_mla_inputs(seed_layout, seed=5, xp=np)
    pages = 512 // page
    assert inp.k_cache.shape == (3 * pages, page, 1, 576) and shape.num_blocks == 3 * pages
    assert (inp.block_table == np.arange(3 * pages).reshape(3, pages)).all()
    assert (inp.k_cache.reshape(3, 512, 1, 576).view(np.uint16)
            == seed_inp.k_cache.reshape(3, 512, 1, 576).view(np.uint16)).all()
    out, lse = reference.mla_decode(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, causal=True)
    seed_out, seed_lse = reference.mla_decode(seed_inp.q, seed_inp.k_cache, seed_inp.block_table,
                                              seed_inp.cache_seqlens, 512, causal=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert (out == seed_out).all() and (lse == seed_lse).all()
    got_out, got_lse = targets.setup_cupy_baseline(inp).result
    assert reference.cos_diff(got_out, out) < 1e-5 and reference.cos_diff(got_lse, lse) < 1e-5


def test_fp8_inputs_on_numpy():
    """The dense FP8 cache: uint8 e4m3 codes of the same random values the bf16 cache holds (at
    the fixed k_scale, a float32 0-d array), the NaN code past each request's length, bf16 q equal
    to the bf16 profile's."""
    bf16_shape = shapes.MLAShape(3, 100, 4, 2, True, (70, 130, 2))
    shape = dataclasses.replace(bf16_shape, dtype="fp8")
    inp = inputs.make_mla_inputs(shape, seed=5, xp=np)
    bf16_inp = inputs.make_mla_inputs(bf16_shape, seed=5, xp=np)
    assert bf16_inp.k_scale is None
    assert inp.q.dtype == BF16 and (inp.q.view(np.uint16) == bf16_inp.q.view(np.uint16)).all()
    assert inp.k_cache.shape == bf16_inp.k_cache.shape == (shape.num_blocks, 64, 1, 576) and inp.k_cache.dtype == np.uint8
    assert isinstance(inp.k_scale, np.ndarray) and inp.k_scale.dtype == np.float32 and inp.k_scale.shape == ()
    assert float(inp.k_scale) == np.float32(inputs.FP8_K_SCALE)
    codes = inp.k_cache.reshape(3, shape.max_seqlen_pad, 1, 576)
    values = quant.dequantize_fp8_per_tensor(codes, inp.k_scale)
    bf16_values = baselines.to_compute(bf16_inp.k_cache).reshape(codes.shape)
    for i, n in enumerate(shape.seqlens):
        assert (codes[i, n:] == 0x7F).all() and np.isnan(values[i, n:]).all()
        assert np.isfinite(values[i, :n]).all() and (codes[i, :n] != 0).mean() > 0.9      # random data, not zeros
        # The same values: e4m3 keeps 3 mantissa bits (half a step: 1/16 relative), bf16 8.
        assert np.allclose(values[i, :n], bf16_values[i, :n], rtol=1 / 16 + 1 / 256, atol=float(inp.k_scale) / 512)
    out, lse, _ = runner._mla_reference(inp)           # --check reads the codes with k_scale
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    again = inputs.make_mla_inputs(shape, seed=5, xp=np)
    assert (again.k_cache == inp.k_cache).all()


def test_e4m3_q_inputs_on_numpy():
    """An e4m3 q: uint8 codes of the same random values the bf16 q holds, at the fixed q_scale (a
    float32 0-d array); the FP8 cache as with bf16 q; --check reads the codes with q_scale."""
    bf16_q = shapes.MLAShape(3, 100, 4, 2, True, (70, 130, 2), dtype="fp8")
    shape = dataclasses.replace(bf16_q, q_dtype="fp8")
    inp = inputs.make_mla_inputs(shape, seed=5, xp=np)
    bf16_inp = inputs.make_mla_inputs(bf16_q, seed=5, xp=np)
    assert bf16_inp.q_scale is None and bf16_inp.format_kwargs().keys() == {"is_fp8_kvcache", "k_scale"}
    assert inp.q.shape == (3, 2, 4, 576) and inp.q.dtype == np.uint8
    assert isinstance(inp.q_scale, np.ndarray) and inp.q_scale.dtype == np.float32 and inp.q_scale.shape == ()
    assert float(inp.q_scale) == np.float32(inputs.FP8_Q_SCALE) != np.float32(inputs.FP8_K_SCALE)
    assert (inp.k_cache == bf16_inp.k_cache).all() and float(inp.k_scale) == float(bf16_inp.k_scale)
    q = quant.dequantize_fp8_per_tensor(inp.q, inp.q_scale, np.float64)       # exact: as the reference reads it
    assert np.isfinite(q).all() and (inp.q != 0).mean() > 0.9                  # random data, not zeros
    # The same values: e4m3 keeps 3 mantissa bits (half a step: 1/16 relative), bf16 8.
    assert np.allclose(q, baselines.to_compute(bf16_inp.q), rtol=1 / 16 + 1 / 256, atol=float(inp.q_scale) / 512)
    assert inp.format_kwargs() == {"is_fp8_kvcache": True, "k_scale": inp.k_scale, "q_scale": inp.q_scale}
    out, lse, limits = runner._mla_reference(inp)
    want_out, want_lse = reference.mla_decode(q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512,
                                              causal=True, k_scale=inp.k_scale)
    assert np.isfinite(out).all() and (out == want_out).all() and (lse == want_lse).all()
    assert limits == reference.COS_DIFF_LIMITS["fp8q"] != runner._mla_reference(bf16_inp)[2]   # P in e4m3
    again = inputs.make_mla_inputs(shape, seed=5, xp=np)
    assert (again.q == inp.q).all()


@pytest.mark.parametrize("dtype, q_dtype", [("fp8", "bf16"), ("fp8", "fp8"), ("bf16", "bf16")])
def test_the_default_call_over_the_fp8_cache_gets_its_scales(monkeypatch, dtype, q_dtype):
    """What is timed is the call users make: over the FP8 cache with is_fp8_kvcache and k_scale (and
    an e4m3 q's q_scale), over a 16-bit cache with none of them."""
    from flashmla_cupy import mla

    calls = []
    monkeypatch.setattr(mla, "get_mla_metadata", lambda seqlens, heads, h_kv: ("metadata", "splits"))
    monkeypatch.setattr(mla, "flash_mla_with_kvcache", lambda *args, **kwargs: calls.append((args, kwargs)))
    shape = shapes.MLAShape(2, 100, 16, 2, False, (100, 100), dtype=dtype, q_dtype=q_dtype)
    inp = inputs.make_mla_inputs(shape, xp=np)
    targets.setup_flashmla(inp).run()
    args, kwargs = calls[-1]
    assert args[0] is inp.q and args[1] is inp.k_cache and args[5:] == ("metadata", "splits")
    want = {"causal": True}
    if dtype == "fp8":
        want.update(is_fp8_kvcache=True, k_scale=inp.k_scale)
    if q_dtype == "fp8":
        want.update(q_scale=inp.q_scale)
    assert kwargs == want


# --------------------------------------------------------------------------------------------
# The profile loop, end to end on NumPy
# --------------------------------------------------------------------------------------------

class FakeSession:
    """Stands in for ``runner.CudaSession``: calls the target like the timer does, reports fixed
    times (the baselines 10x slower) and the anchor run's ceilings."""

    SLOW = ("cupy", "flash_mla")
    stream = "profiler-stream"
    clock_note = "not sampled (the CPU tests' stand-in)"

    def __init__(self, config, clock_fields=None):
        self.config, self.flush, self.calls = config, None, 0
        self.clock_fields = clock_fields or {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def ceilings(self):
        return ceilings.Ceilings(ANCHOR_COPY_GBPS, ANCHOR_MATMUL_TFLOPS, "fake copy", "fake matmul")

    def time(self, fn):
        fn()
        self.calls += 1
        scale = 10.0 if self.current in self.SLOW else 1.0
        return [scale * x for x in (0.20, 0.21, 0.22, 0.25, 0.19)], self.clock_fields

    def free(self):
        pass


def _stand_in_kernel(inp):
    """The default call on NumPy: the plain baseline; over the FP8 cache, which that cannot read,
    the float64 reference rounded to the call's output dtypes (bf16 out, float32 lse)."""
    if inp.k_scale is None:
        return targets.setup_cupy_baseline(inp)

    def run():
        out, lse, _ = runner._mla_reference(inp)
        return baselines.from_float32(out.astype(np.float32), BF16), lse.astype(np.float32)
    return targets.Prepared(run, run())


def _numpy_mla_workload(session: FakeSession, broken: bool = False, real: tuple[str, ...] = (),
                        dtype: str = "bf16"):
    """The MLA workload of ``dtype`` on NumPy: ``flashmla`` is ``_stand_in_kernel``, ``cupy`` and
    ``flash_mla`` run the plain baseline with their own ``supports`` (FlashMLA's page size rule,
    no FP8 cache for either); the targets named in ``real`` are the profiler's own
    (``targets.MLA_TARGETS``), with their requires()."""
    def tracked(name, setup):
        def wrapped(inp):
            session.current = name
            if broken and name == "flashmla":
                raise RuntimeError("kernel exploded\nsecond line")
            return setup(inp)
        return wrapped

    table = {
        "flashmla": targets.Target("flashmla", "stand-in", tracked("flashmla", _stand_in_kernel)),
        "cupy": targets.Target("cupy", "plain baseline", tracked("cupy", targets.setup_cupy_baseline),
                               supports=targets.MLA_TARGETS["cupy"].supports),
        "flash_mla": targets.Target("flash_mla", "stand-in", tracked("flash_mla", targets.setup_cupy_baseline),
                                    supports=targets.MLA_TARGETS["flash_mla"].supports),
    }
    for name in real:
        t = targets.MLA_TARGETS[name]
        table[name] = dataclasses.replace(t, setup=tracked(name, t.setup))
    return dataclasses.replace(runner.mla_workload(dtype), table=table,
                               make_inputs=functools.partial(inputs.make_mla_inputs, xp=np))


def _small_grid():
    return shapes.mla_grid(batches=(2,), seqlens=(100, 200), heads=(16,), s_qs=(1, 2), varlens=(False, True))


def test_run_produces_records_with_every_number():
    config = runner.RunConfig(targets=["flashmla", "cupy"], baseline="cupy", check=True, repeats=5)
    session = FakeSession(config)
    seen = []
    result = runner.run(_numpy_mla_workload(session), _small_grid(), config, gpu={}, session=session,
                        on_record=seen.append)
    assert len(result.records) == 16 == len(seen) and session.calls == 16
    for r in result.records:
        assert "error" not in r, r.get("error")
        assert r["check_ok"] is True and r["cos_diff_out"] < 1e-5 and r["cos_diff_lse"] < 1e-5
        assert r["bound"] == "memory" and 0 < r["roof_fraction"] < 1
        assert r["ms_median"] == pytest.approx(0.21 if r["name"] == "flashmla" else 2.1)
        assert r["gbps"] == pytest.approx(r["bytes"] / (r["ms_median"] * 1e-3) / 1e9)
    main = [r for r in result.records if r["name"] == "flashmla"]
    assert all(r["speedup"] == pytest.approx(10.0) and r["speedup_vs"] == "cupy" for r in main)
    assert not result.interrupted and result.ceilings.copy_gbps == ANCHOR_COPY_GBPS


def test_clock_fields_summarize_the_samples():
    S = clocks.Sample
    samples = [S(1980, 450.0, 0x0), S(1455, 690.0, 0x4), S(1500, 700.0, 0x4 | 0x1), S(1410, 695.0, 0x80),
               S(1980, 300.0, 0x1), S(1700, 500.0, 0x20)]
    f = clocks.clock_fields(samples)
    assert f == {"sm_clock_mhz": pytest.approx(10025 / 6), "sm_clock_min_mhz": 1410, "power_w": 595.0,
                 "power_capped": pytest.approx(3 / 6), "thermal_slowdown": pytest.approx(1 / 6), "clock_samples": 6}
    assert clocks.clock_fields([]) == {}
    assert (clocks.clock_note("matmul ceiling", f)
            == "matmul ceiling at SM 1671 MHz (mean of 6 samples), power-capped in 50 % of them")
    assert clocks.clock_cell({"sm_clock_mhz": 1455.0, "power_capped": 0.9}) == "1455 cap"
    assert clocks.clock_cell({"sm_clock_mhz": 1980.0, "power_capped": 0.5, "thermal_slowdown": 0.0}) == "1980"
    assert clocks.clock_cell({"sm_clock_mhz": 1700.0, "power_capped": 0.0, "thermal_slowdown": 0.6}) == "1700 hot"
    assert clocks.clock_cell({}) == "–"


def test_sampling_reads_at_both_ends_and_on_its_thread():
    class Device:
        def __init__(self):
            self.reads = 0

        def read(self):
            self.reads += 1
            return clocks.Sample(1980 - self.reads, 600.0, 0x4)

    dev = Device()
    sampler = clocks.ClockSampler(dev, interval_s=0.001)
    with sampler.sampling() as run:
        time.sleep(0.05)
    assert dev.reads == len(run.samples) >= 5                  # the ends and some on the thread
    f = run.stats()
    assert f["clock_samples"] == dev.reads and f["power_capped"] == 1.0 and f["sm_clock_min_mhz"] == 1980 - dev.reads


def test_no_nvml_means_no_clocks_and_says_why(monkeypatch):
    def unavailable(pci_bus_id):
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(clocks, "_NvmlDevice", unavailable)
    sampler, note = clocks.ClockSampler.open("0000:18:00.0")
    assert sampler is None and note == "not sampled (NVML unavailable: ImportError: No module named 'pynvml')"


def test_nvml_through_nvidia_ml_py_where_cuda_bindings_has_none(monkeypatch):
    """The pynvml path (the lent GPUs' cuda-bindings has NVML, so only here is it run): the
    environment's driver version and clocks, and the sampler's readings, by PCI bus id."""
    import types

    import cuda.bindings

    calls = []
    fake = types.SimpleNamespace(
        NVML_CLOCK_SM=0, NVML_CLOCK_MEM=2,
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: b"580.159.04",
        nvmlDeviceGetHandleByPciBusId=lambda bus: ("handle", bus),
        nvmlDeviceGetClockInfo=lambda h, c: {0: 1455, 2: 3201}[c] if h == ("handle", "0000:18:00.0") else None,
        nvmlDeviceGetMaxClockInfo=lambda h, c: {0: 1980, 2: 3201}[c],
        nvmlDeviceGetPowerUsage=lambda h: 690_500,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x4)
    monkeypatch.delattr(cuda.bindings, "nvml", raising=False)
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvml", None)     # the import fails
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert env._nvml_driver() == "580.159.04"
    assert env._nvml_clocks("0000:18:00.0") == {"sm_clock_mhz": 1455, "sm_clock_max_mhz": 1980,
                                                "mem_clock_mhz": 3201, "mem_clock_max_mhz": 3201}
    sampler, note = clocks.ClockSampler.open("0000:18:00.0")
    assert "NVML via pynvml" in note
    assert sampler.device.read() == clocks.Sample(1455, 690.5, 0x4)
    sampler.close()
    assert calls == ["init", "shutdown"] * 3


def test_run_records_the_clocks_and_the_table_shows_them():
    config = runner.RunConfig(targets=["flashmla", "cupy"], baseline="cupy", repeats=5)
    fields = {"sm_clock_mhz": 1455.0, "sm_clock_min_mhz": 1410, "power_w": 690.0, "power_capped": 1.0,
              "thermal_slowdown": 0.0, "clock_samples": 40}
    session = FakeSession(config, clock_fields=fields)
    result = runner.run(_numpy_mla_workload(session), _small_grid()[:2], config, gpu={}, session=session)
    assert all(r.items() >= fields.items() for r in result.records)
    assert result.method["clocks"] == FakeSession.clock_note
    table, _ = report.results_table(result.records, kind="mla", main="flashmla", others=["cupy"])
    assert "clock\nMHz" in [c.header for c in table.columns] and list(table.columns[-3].cells) == ["1455 cap"] * 2
    unsampled = FakeSession(config)
    records = runner.run(_numpy_mla_workload(unsampled), _small_grid()[:2], config, gpu={}, session=unsampled).records
    plain, _ = report.results_table(records, kind="mla", main="flashmla", others=["cupy"])
    assert "clock\nMHz" not in [c.header for c in plain.columns]


def test_run_records_a_failing_target_and_goes_on():
    config = runner.RunConfig(targets=["flashmla", "cupy"], baseline="cupy")
    session = FakeSession(config)
    notes = []
    result = runner.run(_numpy_mla_workload(session, broken=True), _small_grid()[:2], config, gpu={},
                        session=session, on_note=notes.append)
    errors = [r for r in result.records if r["name"] == "flashmla"]
    assert all(r["error"] == "RuntimeError: kernel exploded" for r in errors)
    assert all("ms_median" in r for r in result.records if r["name"] == "cupy")
    assert len(notes) == 2 and "\n" not in notes[0]


def test_run_survives_inputs_that_do_not_fit():
    config = runner.RunConfig(targets=["flashmla", "cupy"])
    session = FakeSession(config)
    work = _numpy_mla_workload(session)

    def make_inputs(shape, seed):
        if shape.mean_seqlen == 200:
            raise MemoryError("Out of memory allocating 6,000,000,000 bytes")
        return inputs.make_mla_inputs(shape, seed, xp=np)

    work = dataclasses.replace(work, make_inputs=make_inputs)
    result = runner.run(work, _small_grid(), config, gpu={}, session=session)
    failed = [r for r in result.records if "error" in r]
    assert len(failed) == 8 and all(r["mean_seqlen"] == 200 and "Out of memory" in r["error"] for r in failed)
    assert len(result.records) == 16


def test_unavailable_targets_are_skipped_with_the_reason():
    table = {"a": targets.Target("a", "", lambda inp: None, lambda: "needs a thing")}
    ok, skipped = runner.usable_targets(["a"], table)
    assert ok == [] and skipped == {"a": "needs a thing"}


def test_flash_mla_is_not_applicable_at_other_page_sizes():
    """FlashMLA takes 64-token pages only: at other sizes its row is skipped with the reason (no
    time, no error, no speed-up) while the main target runs and checks at every size."""
    from rich.console import Console

    assert targets.MLA_TARGETS["flash_mla"].supports(_small_grid()[0]) is None
    config = runner.RunConfig(targets=["flashmla", "flash_mla"], baseline="flash_mla", check=True)
    session = FakeSession(config)
    grid = shapes.mla_grid(batches=(2,), seqlens=(100,), heads=(16,), s_qs=(2,), varlens=(True,),
                           page_sizes=(16, 64, 128))
    notes = []
    result = runner.run(_numpy_mla_workload(session), grid, config, gpu={}, session=session,
                        on_note=notes.append)
    assert session.calls == 4 and notes == [] and not result.skipped_targets
    by_page = {(r["name"], r["page_size"]): r for r in result.records}
    for page in (16, 64, 128):
        main = by_page["flashmla", page]
        assert "error" not in main and main["check_ok"] is True and main["ms_median"] > 0
        assert ("speedup" in main) == (page == 64)
        fm = by_page["flash_mla", page]
        if page == 64:
            assert fm["ms_median"] > 0 and "skipped" not in fm
        else:
            assert fm["skipped"] == "FlashMLA's dense call takes pages of 64 tokens only"
            assert not {"error", "ms_median", "cos_diff_out"} & set(fm)
    assert report.skipped_lines(result.records) == [
        "flash_mla at 2 of 3 shapes: FlashMLA's dense call takes pages of 64 tokens only"]
    table, errors = report.results_table(result.records, kind="mla", main="flashmla", others=["flash_mla"])
    console = Console(record=True, width=250)
    console.print(table)
    rows = console.export_text().splitlines()
    assert not errors and next(line for line in rows if "TFLOP/s" in line).split()[:5] == [
        "b", "s_k", "h_q", "s_q", "page"]
    assert [line.split()[4] for line in rows if "n/a" in line] == ["16", "128"]
    default_pages = [r for r in result.records if r["page_size"] == 64]
    console.print(report.results_table(default_pages, kind="mla", main="flashmla", others=["flash_mla"])[0])
    console.print(report.check_table(default_pages, kind="mla", targets=["flashmla", "flash_mla"]))
    assert "page" not in console.export_text()           # the seed's pages only: the table as it was


@pytest.mark.parametrize("q_dtype", ["bf16", "fp8"])
def test_baselines_are_not_applicable_over_the_fp8_cache(q_dtype):
    """FlashMLA has no dense FP8 decoding on Hopper and the plain CuPy baseline reads 16-bit q and
    caches: over the FP8 cache, read by bf16 or e4m3 q, their rows are n/a with the reason, while the
    default call runs and checks."""
    fp8 = shapes.mla_grid(batches=(2,), seqlens=(100,), heads=(16,), s_qs=(1, 2), varlens=(True,), dtype="fp8",
                          q_dtype=q_dtype)
    for name, why in (("flash_mla", ("FlashMLA has no dense FP8 decoding on Hopper (its FP8 cache is the sparse one, "
                                     "read by bf16 q)")),
                      ("cupy", "the plain CuPy baseline reads bf16/fp16 q and caches only")):
        assert targets.MLA_TARGETS[name].supports(fp8[0]) == why
        bf16 = dataclasses.replace(fp8[0], dtype="bf16", q_dtype="bf16")
        assert targets.MLA_TARGETS[name].supports(bf16) is None
        config = runner.RunConfig(targets=["flashmla", name], baseline=name, check=True)
        session = FakeSession(config)
        result = runner.run(_numpy_mla_workload(session, dtype="fp8"), fp8, config, gpu={}, session=session)
        assert session.calls == 2
        for r in result.records:
            assert (r["dtype"], r["q_dtype"]) == ("fp8", q_dtype)
            assert r["bytes"] == shapes.mla_bytes(fp8[r["shape_index"]])
            if r["name"] == "flashmla":
                assert r["check_ok"] is True and r["ms_median"] > 0 and "speedup" not in r
            else:
                assert r["skipped"] == why and not {"error", "ms_median", "cos_diff_out"} & set(r)
        assert report.skipped_lines(result.records) == [f"{name} at 2 of 2 shapes: {why}"]
        assert ceilings.NO_FP8_MATMUL in result.ceilings.notes
    assert ceilings.NO_FP8_MATMUL not in runner.mla_workload("bf16").ceiling_notes


def test_attention_run_on_numpy():
    """The attention sweep's loop, checks and table, with NumPy stand-ins for the two kernels."""
    from rich.console import Console

    def setup(inp):
        def run():
            return reference.attention(inp.q, inp.k, inp.v, causal=inp.shape.causal)[0].astype(np.float32)
        return targets.Prepared(run, run())

    table = {n: targets.Target(n, "", setup) for n in ("flash_attn_minimal", "manual")}
    work = dataclasses.replace(runner.attention_workload(), table=table,
                               make_inputs=functools.partial(inputs.make_attention_inputs, xp=np))
    config = runner.RunConfig(targets=["flash_attn_minimal", "manual"], baseline="manual", check=True)
    session = FakeSession(config)
    session.current = "flash_attn_minimal"
    grid = shapes.attention_grid(2, 3, 16, (32, 64))
    result = runner.run(work, grid, config, gpu={}, session=session)
    assert len(result.records) == 4
    for r in result.records:
        assert r["check_ok"] and r["max_abs_out"] < 1e-5 and r["head_dim"] == 16
        assert r["flops"] == 4 * 2 * 3 * r["seqlen"] ** 2 * 16
    t, errors = report.results_table(result.records, kind="attention", main="flash_attn_minimal",
                                     others=["manual"], check=True)
    console = Console(record=True, width=250)
    console.print(t)
    text = console.export_text()
    assert not errors and "flash_attn_minimal" in text and "manual" in text and "×" in text
    console.print(report.check_table(result.records, kind="attention", targets=["flash_attn_minimal", "manual"]))
    assert "lse" not in console.export_text()


@pytest.fixture
def measured(tmp_path):
    config = runner.RunConfig(targets=["flashmla", "cupy"], baseline="cupy", check=True)
    session = FakeSession(config)
    result = runner.run(_numpy_mla_workload(session), _small_grid(), config, gpu={}, session=session)
    return result, config


def test_csv_has_the_seed_columns_first_and_every_number(measured, tmp_path):
    result, _ = measured
    path = report.write_csv(tmp_path / "out" / "all_perf.csv", result.records, result.ceilings)
    with path.open() as f:
        rows = list(csv.DictReader(f))
        f.seek(0)
        header = next(csv.reader(f))
    assert header[:5] == ["name", "batch", "seqlen", "head", "bw"]
    for col in ("ms_median", "ms_p10", "ms_p90", "tflops", "gbps", "frac_copy_bw", "frac_matmul", "bound",
                "speedup", "cos_diff_out", "max_abs_lse", "copy_gbps_ceiling", "varlen", "s_q", "dtype",
                "q_dtype"):
        assert col in header, col
    assert "shape_index" not in header and "page_size" in header
    assert header[header.index("dtype") + 1] == "q_dtype"          # with the shape, not among the extras
    assert len(rows) == 16 and {r["name"] for r in rows} == {"flashmla", "cupy"}
    assert {(r["page_size"], r["dtype"], r["q_dtype"]) for r in rows} == {("64", "bf16", "bf16")}
    first = rows[0]
    assert int(first["batch"]) == 2 and int(first["head"]) == 16 and float(first["bw"]) > 0
    assert float(first["copy_gbps_ceiling"]) == ANCHOR_COPY_GBPS
    assert first["speedup"] and float(first["speedup"]) == pytest.approx(10.0)
    varlen = [r for r in rows if r["varlen"] == "True"]
    assert varlen and all(int(r["seqlen"]) == round(float(r["seqlen_mean"])) for r in varlen)


def test_json_has_environment_ceilings_and_records(measured, tmp_path):
    result, config = measured
    fake_env = {"versions": {"cupy": "14.2.0"}, "gpu": {"name": "Fake H100", "sm_count": 132}, "pdl": "on"}
    records = result.records + [{"name": "flashmla", "shape_index": 99, "cos_diff_out": math.inf}]
    payload = report.json_payload(kind="mla", records=records, ceilings=result.ceilings,
                                  method=result.method, environment=fake_env, config=config.as_dict())
    path = report.write_json(tmp_path / "r.json", payload)
    data = json.loads(path.read_text())
    assert data["kind"] == "mla" and data["schema"] == 1
    assert data["ceilings"]["copy_gbps"] == ANCHOR_COPY_GBPS
    assert data["ceilings"]["matmul_tflops"] == ANCHOR_MATMUL_TFLOPS
    assert data["environment"]["gpu"]["name"] == "Fake H100"
    assert data["config"]["baseline"] == "cupy" and data["config"]["targets"] == ["flashmla", "cupy"]
    assert "timed" in data["method"]
    assert len(data["records"]) == 17 and data["records"][-1]["cos_diff_out"] is None
    r0 = data["records"][0]
    for key in ("ms_median", "ms_p10", "ms_p90", "ms_q1", "ms_q3", "tflops", "gbps", "flops", "bytes",
                "bound", "roof_fraction", "seqlen_mean", "total_seqlen", "cos_diff_out"):
        assert key in r0, key


def test_table_and_plot(measured, tmp_path):
    from rich.console import Console

    result, _ = measured
    table, errors = report.results_table(result.records, kind="mla", main="flashmla", others=["cupy"],
                                         check=True, title="MLA")
    console = Console(record=True, width=250)
    console.print(table)
    text = console.export_text()
    assert errors == []
    assert "flashmla" in text and "cupy" in text and "10.0×" in text and "memory" in text
    assert "0.210" in text and "100~" in text and "±" in text
    check = report.check_table(result.records, kind="mla", targets=["flashmla", "cupy"])
    console.print(check)
    text = console.export_text()
    assert "cos_diff" in text and "lse" in text and "1e-05" in text
    if report.matplotlib_status() is None:
        png = report.plot(tmp_path / "p.png", result.records, result.ceilings, kind="mla", title="t")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_header_lines_name_the_method():
    fake_env = {"versions": {"cupy": "14.2.0", "nvrtc": "12.9", "cuda_driver": "13.0"},
                "gpu": {"name": "Fake", "sm_count": 132, "arch": "sm_90a", "memory_bytes": 80 << 30,
                        "l2_bytes": 50 << 20, "sm_clock_max_mhz": 1980}, "pdl": "on"}
    config = runner.RunConfig(targets=["flashmla"])
    method = runner.method_description(config, 50 << 20, "mla")
    rows = dict(report.header_lines(fake_env, method, kind="mla", seed=0))
    assert "split-KV + combine" in rows["Timed"] and "PDL on" in rows["Timed"]
    assert "132 SMs" in rows["GPU"] and "1980 MHz" in rows["GPU"]
    assert "random.Random(0)" in rows["Seed"] and "576+512" in rows["Formulas"]
    assert "memset of 256 MiB" in rows["Method"]
    for mode, words in (("read", "reading 256 MiB"), ("none", "L2 not flushed")):
        method = runner.method_description(runner.RunConfig(targets=["flashmla"], flush=mode), 50 << 20, "mla")
        assert words in dict(report.header_lines(fake_env, method, kind="mla", seed=0))["Method"]


def test_method_names_the_default_call_its_inputs_and_value_check_mode():
    import flashmla_cupy

    for inputs_, mode, words in (("cupy", "async", "CuPy arrays"), ("torch", "sync", "torch tensors")):
        config = runner.RunConfig(targets=[targets.MAIN_MLA_TARGETS[inputs_]], inputs=inputs_, value_checks=mode)
        method = runner.method_description(config, 50 << 20, "mla")
        assert f"default call: value checks in their current mode ({mode})" in method["timed"]
        assert words in method["timed"] and "split-KV + combine" in method["timed"]
        assert (method["inputs"], method["value_checks"]) == (inputs_, mode) and "baseline" not in method
    with flashmla_cupy.value_checks("off"):              # not configured: the library's current mode
        method = runner.method_description(runner.RunConfig(targets=["flashmla"]), 50 << 20, "mla")
    assert "current mode (off)" in method["timed"] and method["value_checks"] == "off"
    config = runner.RunConfig(targets=["flashmla", "flash_mla"], baseline="flash_mla", graph=True,
                              value_checks="sync")
    method = runner.method_description(config, 50 << 20, "mla")
    assert "not synchronizing inside the graph" in method["timed"]
    assert method["baseline"].startswith("flash_mla: FlashMLA's own flash_mla_with_kvcache")
    assert "speed-up = its median / flashmla's" in method["baseline"]
    rows = dict(report.header_lines({"versions": {}, "gpu": {}}, method, kind="mla", seed=0))
    assert rows["Baseline"] == method["baseline"]
    attention = runner.method_description(runner.RunConfig(targets=["flash_attn_minimal"]), 50 << 20, "attention")
    assert "value_checks" not in attention and "inputs" not in attention


def test_run_uses_the_configured_value_check_mode_and_restores_it():
    import flashmla_cupy

    before = flashmla_cupy.value_check_mode()
    wanted = "off" if before != "off" else "sync"
    seen = []

    def setup(inp):
        seen.append(flashmla_cupy.value_check_mode())
        return targets.setup_cupy_baseline(inp)

    config = runner.RunConfig(targets=["flashmla"], value_checks=wanted)
    session = FakeSession(config)
    session.current = "flashmla"
    work = dataclasses.replace(_numpy_mla_workload(session), table={"flashmla": targets.Target("flashmla", "", setup)})
    result = runner.run(work, _small_grid()[:2], config, gpu={}, session=session)
    assert seen == [wanted, wanted] and result.method["value_checks"] == wanted
    assert flashmla_cupy.value_check_mode() == before


# --------------------------------------------------------------------------------------------
# --inputs torch and --baseline flash_mla, on the CPU: torch tensors on the host, a stand-in
# FlashMLA module in each API generation (the GPU runs are at the end)
# --------------------------------------------------------------------------------------------

def _fp16_grid():
    return shapes.mla_grid(batches=(2,), seqlens=(100,), heads=(16,), s_qs=(1, 2), varlens=(False, True),
                           dtype="fp16")


def _reference_call(torch, q, k_cache, block_table, cache_seqlens, head_dim_v, causal, **scales):
    """The float64 reference on host tensors, rounded to the call's output dtypes (out bf16 for an
    e4m3 q); ``scales``: the FP8 cache's k_scale and an e4m3 q's q_scale, tensors."""
    out, lse = reference.mla_decode(q.numpy(), k_cache.numpy(), block_table.numpy(), cache_seqlens.numpy(),
                                    head_dim_v, causal=causal, **{k: v.numpy() for k, v in scales.items()})
    out_dtype = torch.bfloat16 if q.element_size() == 1 else q.dtype
    return torch.from_numpy(out).to(out_dtype), torch.from_numpy(lse).float()


def _stand_in_flash_mla(api: str, calls: list):
    """A module with FlashMLA's functions in the seed's (2025-04) or upstream's (9241ae3) form."""
    import types

    torch = pytest.importorskip("torch")
    mod = types.ModuleType("flash_mla")
    mod.__version__ = f"stand-in-{api}"
    if api == "seed":
        def get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k):
            assert isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32
            calls.append(("metadata", num_heads_per_head_k, num_heads_k))
            return "seed-metadata", "seed-splits"

        def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                   num_splits, softmax_scale=None, causal=False):
            assert (tile_scheduler_metadata, num_splits) == ("seed-metadata", "seed-splits")
            calls.append(("call", head_dim_v, causal))
            return _reference_call(torch, q, k_cache, block_table, cache_seqlens, head_dim_v, causal)
    else:
        class FlashMLASchedMeta:
            have_initialized = False

        def get_mla_metadata(*args, **kwargs):
            calls.append(("metadata", *args, *kwargs))
            return FlashMLASchedMeta(), None

        def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                   num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                                   indices=None):
            assert isinstance(tile_scheduler_metadata, FlashMLASchedMeta) and num_splits is None
            calls.append(("call", head_dim_v, causal, tile_scheduler_metadata.have_initialized))
            tile_scheduler_metadata.have_initialized = True
            return _reference_call(torch, q, k_cache, block_table, cache_seqlens, head_dim_v, causal)
    mod.get_mla_metadata, mod.flash_mla_with_kvcache = get_mla_metadata, flash_mla_with_kvcache
    return mod


@pytest.fixture
def torch_on_cpu(monkeypatch):
    """torch targets on host tensors: requires() passes, no CUDA device or stream switch, results
    come back as NumPy arrays. Returns ``(torch, streams the targets were timed on, DLPack calls)``."""
    import contextlib

    torch = pytest.importorskip("torch")
    streams, dlpack_calls = [], []

    @contextlib.contextmanager
    def on_stream(stream):
        streams.append(stream)
        yield

    real_from_dlpack = torch.from_dlpack

    def from_dlpack(x):
        dlpack_calls.append(x)
        return real_from_dlpack(x)

    monkeypatch.setattr(targets.torch_drop_in, "torch_unavailable", lambda: None)
    monkeypatch.setattr(targets.torch_drop_in, "cupy_device", lambda array: contextlib.nullcontext())
    monkeypatch.setattr(targets.torch_drop_in, "cupy_stream", on_stream)
    monkeypatch.setattr(targets, "_as_cupy", lambda result: tuple(x.float().numpy() for x in result))
    monkeypatch.setattr(torch, "from_dlpack", from_dlpack)
    return torch, streams, dlpack_calls


def test_flash_mla_api_generation_is_read_from_get_mla_metadata():
    calls = []
    assert targets.flash_mla_api(_stand_in_flash_mla("seed", calls)) == "seed"
    assert targets.flash_mla_api(_stand_in_flash_mla("upstream", calls)) == "upstream"

    class NoSignature:                       # e.g. a compiled function: the seed's form
        get_mla_metadata = object()
    assert targets.flash_mla_api(NoSignature) == "seed"


@pytest.mark.parametrize("api", ["seed", "upstream"])
def test_flash_mla_baseline_beside_the_default_call(monkeypatch, torch_on_cpu, api):
    _, streams, _ = torch_on_cpu
    calls = []
    monkeypatch.setitem(sys.modules, "flash_mla", _stand_in_flash_mla(api, calls))
    config = runner.RunConfig(targets=["flashmla", "flash_mla"], baseline="flash_mla", check=True)
    session = FakeSession(config)
    grid = _fp16_grid()
    result = runner.run(_numpy_mla_workload(session, real=("flash_mla",)), grid, config, gpu={}, session=session)
    assert len(result.records) == 2 * len(grid) and not result.skipped_targets
    for r in result.records:
        assert "error" not in r, r.get("error")
        assert r["check_ok"] is True, r
    fm = [r for r in result.records if r["name"] == "flash_mla"]
    assert all(r["notes"] == f"FlashMLA {api} API (flash_mla stand-in-{api})" for r in fm)
    main = [r for r in result.records if r["name"] == "flashmla"]
    assert all(r["speedup"] == pytest.approx(10.0) and r["speedup_vs"] == "flash_mla" for r in main)
    assert streams == ["profiler-stream"] * len(grid)            # timed on the profiler's stream
    if api == "seed":
        assert [c for c in calls if c[0] == "metadata"] == [("metadata", s.s_q * 16, 1) for s in grid]
        assert all(c == ("call", 512, True) for c in calls if c[0] == "call")
    else:
        assert [c for c in calls if c[0] == "metadata"] == [("metadata",)] * len(grid)
        # per shape: the setup call fills the schedule, the timed call reuses it
        assert [c[3] for c in calls if c[0] == "call"] == [False, True] * len(grid)
    table, errors = report.results_table(result.records, kind="mla", main="flashmla", others=["flash_mla"])
    from rich.console import Console
    console = Console(record=True, width=250)
    console.print(table)
    text = console.export_text()
    assert not errors and "flash_mla" in text and "10.0×" in text


def test_torch_inputs_time_the_drop_in_on_views_made_once_per_shape(monkeypatch, torch_on_cpu):
    from flashmla_cupy import flash_mla as drop_in

    _, streams, dlpack_calls = torch_on_cpu
    calls, fm_calls = [], []
    seed = _stand_in_flash_mla("seed", calls)
    monkeypatch.setattr(drop_in, "get_mla_metadata", seed.get_mla_metadata)
    monkeypatch.setattr(drop_in, "flash_mla_with_kvcache", seed.flash_mla_with_kvcache)
    monkeypatch.setitem(sys.modules, "flash_mla", _stand_in_flash_mla("upstream", fm_calls))
    config = runner.RunConfig(targets=["flashmla_torch", "flash_mla"], baseline="flash_mla", check=True,
                              inputs="torch")
    session = FakeSession(config)
    grid = _fp16_grid()
    result = runner.run(_numpy_mla_workload(session, real=("flashmla_torch", "flash_mla")), grid, config,
                        gpu={}, session=session)
    assert all("error" not in r and r["check_ok"] for r in result.records), result.records
    assert len([c for c in calls if c[0] == "call"]) == 2 * len(grid)         # the drop-in: setup + timed
    assert len(dlpack_calls) == 4 * len(grid)                                 # q, k_cache, table, seqlens
    assert streams == ["profiler-stream"] * (2 * len(grid))
    main = [r for r in result.records if r["name"] == "flashmla_torch"]
    assert all(r["speedup"] == pytest.approx(10.0) and r["speedup_vs"] == "flash_mla" for r in main)


def test_torch_inputs_over_the_fp8_cache_pass_the_scales_as_tensors(monkeypatch, torch_on_cpu):
    """--inputs torch --dtype fp8 --q-dtype fp8: the drop-in gets is_fp8_kvcache, k_scale and
    q_scale, the scales as torch tensors viewing the inputs' (DLPack), q as its e4m3 codes; its
    result checks against the reference."""
    from flashmla_cupy import flash_mla as drop_in

    torch, streams, dlpack_calls = torch_on_cpu
    calls = []

    def stand_in(q, k_cache, block_table, cache_seqlens, head_dim_v, metadata, splits, causal=False, *,
                 is_fp8_kvcache=False, k_scale=None, q_scale=None):
        calls.append((q.dtype, is_fp8_kvcache, k_scale, q_scale))
        return _reference_call(torch, q, k_cache, block_table, cache_seqlens, head_dim_v, causal, k_scale=k_scale,
                               q_scale=q_scale)

    monkeypatch.setattr(drop_in, "get_mla_metadata", lambda seqlens, heads, h_kv: ("metadata", "splits"))
    monkeypatch.setattr(drop_in, "flash_mla_with_kvcache", stand_in)
    config = runner.RunConfig(targets=["flashmla_torch"], check=True, inputs="torch")
    session = FakeSession(config)
    grid = shapes.mla_grid(batches=(2,), seqlens=(100,), heads=(16,), s_qs=(2,), varlens=(True,), dtype="fp8",
                           q_dtype="fp8")
    result = runner.run(_numpy_mla_workload(session, real=("flashmla_torch",), dtype="fp8"), grid, config, gpu={},
                        session=session)
    (r,) = result.records
    assert "error" not in r and r["check_ok"] is True and r["q_dtype"] == "fp8", r
    assert len(calls) == 2 and streams == ["profiler-stream"]            # setup + timed
    q_dtype, is_fp8, k_scale, q_scale = calls[-1]
    assert q_dtype == torch.uint8 and is_fp8 is True
    assert isinstance(k_scale, torch.Tensor) and float(k_scale) == pytest.approx(inputs.FP8_K_SCALE)
    assert isinstance(q_scale, torch.Tensor) and float(q_scale) == pytest.approx(inputs.FP8_Q_SCALE)
    assert len(dlpack_calls) == 4 + 2                                   # q, k_cache, table, seqlens; the scales


def test_torch_and_flash_mla_targets_say_why_they_cannot_run(monkeypatch):
    import builtins
    import types

    from flashmla_cupy import flash_mla as drop_in

    def reasons():
        out = {n: targets.MLA_TARGETS[n].requires() for n in ("flashmla_torch", "flash_mla")}
        assert all(why is None or "\n" not in why for why in out.values())
        return out

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name == "flash_mla":
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    with monkeypatch.context() as m:                                   # torch missing
        m.setattr(builtins, "__import__", no_torch)
        m.delitem(sys.modules, "torch", raising=False)
        m.delitem(sys.modules, "flash_mla", raising=False)
        for name, why in reasons().items():
            assert why and "torch is not importable" in why, (name, why)

    with monkeypatch.context() as m:                                   # torch without CUDA
        fake_torch = types.SimpleNamespace(__version__="9.9+cpu",
                                           cuda=types.SimpleNamespace(is_available=lambda: False))
        m.setitem(sys.modules, "torch", fake_torch)
        for name, why in reasons().items():
            assert why == "torch 9.9+cpu has no CUDA device (a CPU-only build?)", (name, why)

    monkeypatch.setattr(targets.torch_drop_in, "torch_unavailable", lambda: None)   # torch fine from here on
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "flash_mla", None)                      # FlashMLA not installed
        got = reasons()
        assert got["flashmla_torch"] is None
        assert got["flash_mla"].startswith("FlashMLA (the flash_mla package) is not importable here (")
        m.setitem(sys.modules, "flashmla_cupy.flash_mla", None)
        assert "flashmla_cupy.flash_mla (the torch drop-in) unavailable" in reasons()["flashmla_torch"]

    shim = types.ModuleType("flash_mla")                               # a shim pointing at our drop-in
    shim.get_mla_metadata, shim.flash_mla_with_kvcache = drop_in.get_mla_metadata, drop_in.flash_mla_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_mla", shim)
    assert "is flashmla-cupy's drop-in, not FlashMLA" in reasons()["flash_mla"]
    monkeypatch.setitem(sys.modules, "flash_mla", types.ModuleType("flash_mla"))
    assert "has no get_mla_metadata" in reasons()["flash_mla"]
    monkeypatch.setitem(sys.modules, "flash_mla", _stand_in_flash_mla("seed", []))
    assert reasons() == {"flashmla_torch": None, "flash_mla": None}


@pytest.mark.parametrize("argv, main, baseline", [
    ([], "flashmla", None),
    (["--inputs", "torch"], "flashmla_torch", None),
    (["--baseline", "flash_mla"], "flashmla", "flash_mla"),
    (["--baseline", "cupy", "--value-checks", "sync"], "flashmla", "cupy"),
    (["--inputs", "torch", "--baseline", "flash_mla", "--value-checks", "off"], "flashmla_torch", "flash_mla"),
    (["attention", "--baseline", "flash_mla"], "flash_attn_minimal", "manual"),
    (["sparse"], "flashmla", None),
    (["sparse", "--value-checks", "off"], "flashmla", None),
    (["--dtype", "fp8", "--baseline", "flash_mla", "--page-size", "16"], "flashmla", "flash_mla"),
    (["--dtype", "fp8", "--q-dtype", "fp8", "--inputs", "torch"], "flashmla_torch", None),
    (["--dtype", "fp16", "--q-dtype", "fp16"], "flashmla", None),
    (["sparse", "--q-dtype", "bf16"], "flashmla", None),
])
def test_profile_options_choose_targets_and_mode(monkeypatch, argv, main, baseline):
    import flashmla_cupy
    seen = {}

    def stop(config, need_hopper):
        seen["config"] = config
        raise env.NoGPU("stand-in: stop after parsing")

    monkeypatch.setattr(runner, "require_device", stop)
    before = flashmla_cupy.value_check_mode()
    for library_mode in ("async", "sync"):
        with flashmla_cupy.value_checks(library_mode):
            with pytest.raises(SystemExit):
                cli.main(["profile", "--quick", *argv])
        config = seen["config"]
        assert config.targets == [main] + ([baseline] if baseline else []) and config.baseline == baseline
        assert config.inputs == ("torch" if "torch" in argv else "cupy")
        assert config.matmul_dtype == ("fp32" if "attention" in argv else "bf16")
        if "attention" in argv:
            assert config.value_checks is None
        else:      # --value-checks, else the library's mode at the time
            given = argv[argv.index("--value-checks") + 1] if "--value-checks" in argv else None
            assert config.value_checks == (given or library_mode)
    assert flashmla_cupy.value_check_mode() == before            # parsing changes nothing


def test_profile_value_checks_rejects_unknown_modes():
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", "--value-checks", "maybe"])
    assert excinfo.value.code == 2
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", "--inputs", "jax"])
    assert excinfo.value.code == 2


# --------------------------------------------------------------------------------------------
# Sparse decoding (DeepSeek-V3.2): grid, cost model, inputs, anchors, the loop on NumPy
# --------------------------------------------------------------------------------------------

# A production row at a size NumPy runs in moments (the CLI tests shrink every row to this).
SMALL_SPARSE = {"batch": 2, "h_q": 16, "s_k": 256, "topk": 64}


def _numpy_sparse_workload(session: FakeSession):
    """The sparse workload on NumPy: ``flashmla`` is the float64 reference, rounded to the call's
    output dtypes (bf16 out, float32 lse)."""
    def setup(inp):
        session.current = "flashmla"

        def run():
            out, lse = reference.mla_decode_sparse(inp.q, inp.k_cache, inp.indices, attn_sink=inp.attn_sink)
            return baselines.from_float32(out.astype(np.float32), BF16), lse.astype(np.float32)
        return targets.Prepared(run, run())

    return dataclasses.replace(runner.sparse_workload(), table={"flashmla": targets.Target("flashmla", "", setup)},
                               make_inputs=functools.partial(inputs.make_sparse_inputs, xp=np))


def test_sparse_grid_is_the_v32_production_grid():
    rows = [(2, 128, 2, 32768, 2048), (64, 128, 2, 32768, 2048), (74, 128, 2, 32768, 2048),
            (128, 128, 2, 32768, 2048), (128, 64, 2, 32768, 2048), (128, 128, 1, 32768, 2048),
            (148, 64, 2, 32768, 16384), (148, 128, 2, 32768, 16384)]
    assert [s.key for s in shapes.sparse_grid()] == rows
    assert [s.key for s in shapes.sparse_grid(quick=True)] == rows[:2]
    s = shapes.sparse_grid()[0]
    assert (s.d, s.dv, s.num_blocks, s.attended_tokens) == (576, 512, 2 * 32768 // 64, 2 * 2 * 2048)
    assert s.label() == "b=2 h_q=128 s_q=2 s_k=32768 topk=2048"
    # A list replaces its column in every row: one row per value, duplicates dropped, order kept.
    assert [s.key for s in shapes.sparse_grid(batches=(4,))] == [
        (4, 128, 2, 32768, 2048), (4, 64, 2, 32768, 2048), (4, 128, 1, 32768, 2048),
        (4, 64, 2, 32768, 16384), (4, 128, 2, 32768, 16384)]
    assert [s.key for s in shapes.sparse_grid(batches=(1, 2), s_ks=(4096,), topks=(128,), quick=True)] == [
        (1, 128, 2, 4096, 128), (2, 128, 2, 4096, 128)]
    with pytest.raises(ValueError, match="topk=4096 is more than s_k=2048"):
        shapes.sparse_grid(s_ks=(2048,), topks=(4096,))


def test_sparse_flops_and_bytes_by_hand():
    s = shapes.SparseShape(batch=3, h_q=4, s_q=2, s_k=256, topk=64)
    assert shapes.sparse_flops(s) == 2 * 4 * (3 * 2 * 64) * (576 + 512) == 3_342_336
    # q [3, 2, 4, 576] and out [3, 2, 4, 512] in bf16, 300 distinct tokens of 656 bytes
    assert shapes.sparse_bytes(s, 300) == 2 * 3 * 2 * 4 * 576 + 2 * 3 * 2 * 4 * 512 + 300 * 656 == 249_024


@pytest.mark.parametrize("key, us, tflops", [
    # anchors-sparse-fp8-h200.md: the FLOPs of upstream's lib.py over its µs give its TFLOP/s
    ((2, 128, 2, 32768, 2048), 20.3, 112), ((64, 128, 2, 32768, 2048), 186.9, 391),
    ((74, 128, 2, 32768, 2048), 226.3, 373), ((128, 128, 2, 32768, 2048), 364.6, 400),
    ((128, 64, 2, 32768, 2048), 226.4, 322), ((128, 128, 1, 32768, 2048), 187.0, 390),
    ((148, 64, 2, 32768, 16384), 1866.7, 362), ((148, 128, 2, 32768, 16384), 3050.6, 443),
])
def test_sparse_flops_match_the_anchor_rows(key, us, tflops):
    shape = shapes.SparseShape(*key)
    assert shapes.sparse_flops(shape) / (us * 1e-6) / 1e12 == pytest.approx(tflops, abs=0.6)
    assert anchors.flash_mla_sparse_ms(shape, "NVIDIA H200") == pytest.approx(us / 1e3)


def test_anchors_are_shown_on_an_h200_only():
    shape = shapes.sparse_grid()[0]
    assert anchors.flash_mla_sparse_ms(shape, "NVIDIA H200") == pytest.approx(0.0203)
    assert anchors.flash_mla_sparse_ms(shape, "NVIDIA H200 NVL") == pytest.approx(0.0203)
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H20", ""):
        assert anchors.flash_mla_sparse_ms(shape, name) is None
    assert anchors.flash_mla_sparse_ms(dataclasses.replace(shape, batch=3), "NVIDIA H200") is None
    assert set(anchors.SPARSE_FP8_H200_US) == {s.key for s in shapes.sparse_grid()}


def test_sparse_inputs_on_numpy():
    shape = shapes.SparseShape(batch=3, h_q=4, s_q=2, s_k=256, topk=64)
    inp = inputs.make_sparse_inputs(shape, seed=5, xp=np)
    assert inp.q.shape == (3, 2, 4, 576) and inp.q.dtype == BF16
    assert inp.k_cache.shape == (12, 64, 1, 656) and inp.k_cache.dtype == np.uint8
    assert inp.indices.shape == (3, 2, 64) and inp.indices.dtype == np.int32
    assert inp.attn_sink.shape == (4,) and inp.attn_sink.dtype == np.float32
    assert (inp.cache_seqlens == 256).all() and inp.cache_seqlens.dtype == np.int32
    for i in range(3):                       # request i: distinct tokens of its own s_k per query token
        for j in range(2):
            row = inp.indices[i, j]
            assert len(set(row.tolist())) == 64 and (row >= 256 * i).all() and (row < 256 * (i + 1)).all()
    assert inp.retrieved_tokens == len(np.unique(inp.indices))
    assert 3 * 64 < inp.retrieved_tokens < 3 * 2 * 64       # two draws of 64 in 256 overlap a little
    cache = quant.dequantize_fp8_sparse(inp.k_cache, np.float32)
    assert np.isfinite(cache).all() and (np.abs(cache) > 0).mean() > 0.9     # random data, not zeros
    again = inputs.make_sparse_inputs(shape, seed=5, xp=np)
    assert (again.indices == inp.indices).all() and (again.k_cache == inp.k_cache).all()
    other = inputs.make_sparse_inputs(shape, seed=6, xp=np)
    assert (other.indices != inp.indices).any()


@pytest.mark.parametrize("gpu_name, anchored", [("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", False)])
def test_sparse_run_on_numpy_with_flash_mla_anchors(monkeypatch, gpu_name, anchored):
    small = shapes.sparse_grid(batches=(2, 3), heads=(16,), s_ks=(256,), topks=(64,), quick=True)
    monkeypatch.setattr(anchors, "SPARSE_FP8_H200_US", {small[0].key: 100.0})        # one of the two rows
    config = runner.RunConfig(targets=["flashmla"], check=True)
    session = FakeSession(config)
    result = runner.run(_numpy_sparse_workload(session), small, config, gpu={"name": gpu_name}, session=session)
    ours = [r for r in result.records if r["name"] == "flashmla"]
    assert len(ours) == 2 and all("error" not in r and r["check_ok"] for r in ours), ours
    for r, shape in zip(ours, small):
        assert r["flops"] == shapes.sparse_flops(shape)
        assert r["bytes"] > 2 * shape.batch * 2 * 16 * 1088 + shape.batch * 64 * 656
        assert (r["batch"], r["seqlen"], r["head"], r["s_k"], r["topk"]) == (shape.batch, 256, 16, 256, 64)
    assert ceilings.NO_FP8_MATMUL in result.ceilings.notes
    flash_mla = [r for r in result.records if r["name"] == "flash_mla"]
    if not anchored:
        assert flash_mla == [] and all("speedup" not in r for r in ours)
        return
    (a,) = flash_mla
    assert a["shape_index"] == 0 and a["ms_median"] == 0.1 and a["notes"] == anchors.NOTE
    assert a["bytes"] == ours[0]["bytes"] and a["gbps"] == pytest.approx(a["bytes"] / 1e-4 / 1e9)
    assert ours[0]["speedup"] == pytest.approx(0.1 / ours[0]["ms_median"]) and ours[0]["speedup_vs"] == "flash_mla"
    assert "speedup" not in ours[1]


def test_sparse_run_with_flash_mla_measured_drops_the_anchors(monkeypatch):
    """--baseline flash_mla on an H200: FlashMLA's sparse call is timed in the run, and the anchors
    from another run are not added beside it (one flash_mla record per shape, the measured one)."""
    small = shapes.sparse_grid(batches=(2,), heads=(64,), s_ks=(256,), topks=(64,), quick=True)
    monkeypatch.setattr(anchors, "SPARSE_FP8_H200_US", {small[0].key: 100.0})
    config = runner.RunConfig(targets=["flashmla", "flash_mla"], baseline="flash_mla", check=True)
    session = FakeSession(config)
    work = _numpy_sparse_workload(session)
    ours = work.table["flashmla"]

    def setup_flash_mla(inp):
        prep = ours.setup(inp)
        session.current = "flash_mla"
        return prep

    work = dataclasses.replace(work, table={**work.table, "flash_mla": targets.Target("flash_mla", "", setup_flash_mla)})
    result = runner.run(work, small, config, gpu={"name": "NVIDIA H200"}, session=session)
    (mine,), (theirs,) = ([r for r in result.records if r["name"] == n] for n in ("flashmla", "flash_mla"))
    assert theirs["ms_median"] == pytest.approx(2.1) and "notes" not in theirs and theirs["check_ok"]
    assert mine["speedup"] == pytest.approx(10.0) and mine["speedup_vs"] == "flash_mla"


def test_sparse_run_keeps_the_anchors_when_flash_mla_cannot_run(monkeypatch):
    """--baseline flash_mla where FlashMLA is not importable: the target is skipped with its
    reason, and on an H200 the anchors from another run stand in for it as without the option."""
    small = shapes.sparse_grid(batches=(2,), heads=(64,), s_ks=(256,), topks=(64,), quick=True)
    monkeypatch.setattr(anchors, "SPARSE_FP8_H200_US", {small[0].key: 100.0})
    config = runner.RunConfig(targets=["flashmla", "flash_mla"], baseline="flash_mla")
    session = FakeSession(config)
    work = _numpy_sparse_workload(session)
    unusable = targets.Target("flash_mla", "", lambda inp: None, requires=lambda: "no flash_mla here")
    work = dataclasses.replace(work, table={**work.table, "flash_mla": unusable})
    notes = []
    result = runner.run(work, small, config, gpu={"name": "NVIDIA H200"}, session=session, on_note=notes.append)
    assert result.skipped_targets == {"flash_mla": "no flash_mla here"} and any("no flash_mla here" in n for n in notes)
    (theirs,) = [r for r in result.records if r["name"] == "flash_mla"]
    assert theirs["ms_median"] == 0.1 and theirs["notes"] == anchors.NOTE


def test_flash_mla_sparse_target_takes_its_head_counts():
    t = targets.SPARSE_TARGETS["flash_mla"]
    assert [t.supports(shapes.sparse_grid(heads=(h,), quick=True)[0]) is None for h in (16, 64, 128)] == \
        [False, True, True]
    assert "h_q 64 or 128, not 16" in t.supports(shapes.sparse_grid(heads=(16,), quick=True)[0])


# --------------------------------------------------------------------------------------------
# The command line without a GPU
# --------------------------------------------------------------------------------------------

def _assert_one_line_exit(excinfo, *words):
    code = excinfo.value.code
    assert isinstance(code, str) and "\n" not in code and code.startswith("flashmla-cupy ")
    for w in words:
        assert w in code


@pytest.mark.parametrize("failure", ["raise", "zero"])
def test_profile_without_gpu_exits_with_one_line(monkeypatch, capsys, failure):
    import cupy

    def no_driver():
        raise cupy.cuda.runtime.CUDARuntimeError(35)     # cudaErrorInsufficientDriver

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_driver if failure == "raise" else lambda: 0)
    for argv in (["profile"], [], ["--quick"], ["profile", "attention", "--quick"], ["profile", "sparse"],
                 ["sparse", "--quick", "--check"]):
        with pytest.raises(SystemExit) as excinfo:
            cli.main(argv)
        _assert_one_line_exit(excinfo, "no CUDA GPU")
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err


def test_profile_plot_without_matplotlib(monkeypatch):
    monkeypatch.setattr(report, "matplotlib_status", lambda: report.PLOT_MISSING)
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", "--plot", "x.png"])
    _assert_one_line_exit(excinfo, "matplotlib", "flashmla-cupy[plot]")


@pytest.mark.parametrize("kind", ["mla", "sparse"])
def test_profile_on_non_hopper_exits(monkeypatch, kind):
    monkeypatch.setattr(env, "gpu_count", lambda: 1)
    monkeypatch.setattr(env, "device_info", lambda i: {"name": "Fake A100", "compute_capability": "8.0"})
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", kind, "--quick"])
    _assert_one_line_exit(excinfo, "Hopper", "Fake A100")


@pytest.mark.parametrize("argv, words", [
    (["--baseline", "cupy"], ("--baseline cupy is not available for sparse", "--baseline flash_mla")),
    (["--inputs", "torch"], ("--inputs torch is not available for sparse",)),
    (["--plot", "x.png"], ("--plot is not available for sparse",)),
    (["--seqlens", "1024", "--topk", "2048"], ("topk=2048 is more than s_k=1024",)),
    (["--page-size", "16"], ("--page-size is not available for sparse", "reshapes the same cache")),
])
def test_profile_sparse_refuses_what_it_cannot_do(monkeypatch, argv, words):
    def no_device(config, need_hopper):
        raise AssertionError("refused before looking for a device")

    monkeypatch.setattr(runner, "require_device", no_device)
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", "sparse", *argv])
    _assert_one_line_exit(excinfo, *words)


@pytest.mark.parametrize("argv, words", [
    (["sparse", "--dtype", "fp8"], ("--dtype fp8 is not available for sparse", "656 B/token")),
    (["--dtype", "fp8", "--h-kv", "2"], ("--dtype fp8 takes --h-kv 1 only", "got --h-kv 2")),
    (["--q-dtype", "fp8"], ("--q-dtype fp8 is not available with --dtype bf16, whose q is bf16",
                            "an e4m3 q (fp8) reads the dense FP8 cache only")),
    (["--dtype", "fp16", "--q-dtype", "bf16"],
     ("--q-dtype bf16 is not available with --dtype fp16, whose q is fp16",)),
    (["--dtype", "fp8", "--q-dtype", "fp16"],
     ("--q-dtype fp16 is not available with --dtype fp8, whose q is bf16 or fp8",)),
    (["sparse", "--q-dtype", "fp8"], ("--q-dtype fp8 is not available for sparse", "reads bf16 q")),
])
def test_profile_fp8_refuses_what_it_cannot_do(monkeypatch, argv, words):
    def no_device(config, need_hopper):
        raise AssertionError("refused before looking for a device")

    monkeypatch.setattr(runner, "require_device", no_device)
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", *argv])
    _assert_one_line_exit(excinfo, *words)


FAKE_GPU = {"name": "Fake H100", "sm_count": 132, "arch": "sm_90a", "compute_capability": "9.0",
            "memory_bytes": 80 << 30, "l2_bytes": 50 << 20}


def _smaller(shape):
    """The shape at a size NumPy runs in moments (MLA: 2 requests; sparse: ``SMALL_SPARSE``)."""
    if isinstance(shape, shapes.SparseShape):
        return dataclasses.replace(shape, **SMALL_SPARSE)
    return dataclasses.replace(shape, batch=2, seqlens=shape.seqlens[:2])


def _cli_with_a_stand_in_gpu(monkeypatch, argv, real=(), gpu=FAKE_GPU):
    """cli.main(argv) with the device, the session and the kernels replaced (NumPy underneath, shapes
    made ``_smaller``); ``real`` names targets of ``targets.MLA_TARGETS`` that run as they are."""
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setattr(runner, "require_device", lambda config, need_hopper: gpu)
    monkeypatch.setattr(env, "environment", lambda device: {"versions": {}, "gpu": gpu, "pdl": "on"})
    monkeypatch.setattr(build, "prebuild", lambda *a, **k: None)
    sessions = []

    def fake_workload(kind, dtype="bf16"):
        session = FakeSession(None)
        sessions.append(session)
        return _numpy_sparse_workload(session) if kind == "sparse" else _numpy_mla_workload(session, real=real,
                                                                                             dtype=dtype)

    def fake_run(work, shape_list, config, **kw):
        return real_run(work, [_smaller(s) for s in shape_list], config, session=sessions[-1], **kw)

    real_run = runner.run
    monkeypatch.setattr(runner, "workload", fake_workload)
    monkeypatch.setattr(runner, "run", fake_run)
    return cli.main(argv)


def test_profile_end_to_end_with_a_stand_in_gpu(monkeypatch, tmp_path, capsys):
    """cli → runner → report with the session and the kernels replaced (NumPy underneath)."""
    csv_path, json_path, png = tmp_path / "a.csv", tmp_path / "a.json", tmp_path / "a.png"
    argv = ["profile", "--seqlens", "128,256", "--heads", "16", "--s-q", "1", "--baseline", "cupy",
            "--check", "--csv", str(csv_path), "--json", str(json_path)]
    if report.matplotlib_status() is None:
        argv += ["--plot", str(png)]
    assert _cli_with_a_stand_in_gpu(monkeypatch, argv) == 0
    out = capsys.readouterr().out
    assert "Fake H100" in out and "flashmla" in out and "Ceiling" in out and "cos_diff" in out
    assert f"Clocks {FakeSession.clock_note}" in out
    assert csv_path.read_text().startswith("name,batch,seqlen,head,bw,")
    data = json.loads(json_path.read_text())
    assert len(data["records"]) == 8 and data["environment"]["gpu"]["name"] == "Fake H100"
    assert data["config"]["check"] is True
    if report.matplotlib_status() is None:
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_profile_torch_inputs_with_flash_mla_end_to_end(monkeypatch, tmp_path, capsys, torch_on_cpu):
    """--inputs torch --baseline flash_mla through the CLI: the drop-in and a stand-in FlashMLA on
    host tensors; the speed-up column, the mode and the inputs in the table, CSV and JSON."""
    from flashmla_cupy import flash_mla as drop_in

    seed = _stand_in_flash_mla("seed", [])
    monkeypatch.setattr(drop_in, "get_mla_metadata", seed.get_mla_metadata)
    monkeypatch.setattr(drop_in, "flash_mla_with_kvcache", seed.flash_mla_with_kvcache)
    monkeypatch.setitem(sys.modules, "flash_mla", _stand_in_flash_mla("upstream", []))
    csv_path, json_path = tmp_path / "t.csv", tmp_path / "t.json"
    argv = ["profile", "--dtype", "fp16", "--seqlens", "128", "--heads", "16", "--s-q", "1,2", "--varlen", "off",
            "--inputs", "torch", "--baseline", "flash_mla", "--value-checks", "off", "--check",
            "--csv", str(csv_path), "--json", str(json_path)]
    assert _cli_with_a_stand_in_gpu(monkeypatch, argv, real=("flashmla_torch", "flash_mla")) == 0
    out = capsys.readouterr().out
    assert "flashmla_torch" in out and "flash_mla" in out and "10.0×" in out and "Baseline" in out
    assert not [line for line in out.splitlines() if line.startswith(("error ", "skipped "))]
    assert "note flash_mla: FlashMLA upstream API (flash_mla stand-in-upstream)" in out
    data = json.loads(json_path.read_text())
    assert data["config"]["inputs"] == "torch" and data["config"]["value_checks"] == "off"
    assert data["method"]["value_checks"] == "off" and "current mode (off)" in data["method"]["timed"]
    assert "torch tensors" in data["method"]["timed"] and data["method"]["baseline"].startswith("flash_mla:")
    assert {r["name"] for r in data["records"]} == {"flashmla_torch", "flash_mla"}
    for r in data["records"]:
        assert r["check_ok"] is True
        if r["name"] == "flashmla_torch":
            assert r["speedup"] == pytest.approx(10.0) and r["speedup_vs"] == "flash_mla"
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [float(r["speedup"]) for r in rows if r["name"] == "flashmla_torch"] == [pytest.approx(10.0)] * 2


def test_profile_goes_on_without_flash_mla(monkeypatch, tmp_path, capsys):
    """--baseline flash_mla where FlashMLA is not importable: the reason, no column, exit 0."""
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    json_path = tmp_path / "s.json"
    argv = ["profile", "--seqlens", "128", "--heads", "16", "--s-q", "1", "--varlen", "off",
            "--baseline", "flash_mla", "--check", "--json", str(json_path)]
    assert _cli_with_a_stand_in_gpu(monkeypatch, argv, real=("flash_mla",)) == 0
    out = capsys.readouterr().out
    assert "skipped flash_mla:" in out and "flash_mla\n" not in out.replace(" ", "")
    data = json.loads(json_path.read_text())
    assert {r["name"] for r in data["records"]} == {"flashmla"}
    assert all("speedup" not in r for r in data["records"])


def test_profile_page_sizes_end_to_end(monkeypatch, tmp_path, capsys):
    """--page-size through the CLI: each shape at each size, a page column, FlashMLA n/a (with the
    reason, exit 0) where pages are not 64 tokens, the page size in the CSV and JSON."""
    csv_path, json_path = tmp_path / "p.csv", tmp_path / "p.json"
    argv = ["profile", "--seqlens", "128", "--heads", "16", "--s-q", "1", "--varlen", "off", "--page-size", "16,64",
            "--baseline", "flash_mla", "--check", "--csv", str(csv_path), "--json", str(json_path)]
    assert _cli_with_a_stand_in_gpu(monkeypatch, argv) == 0
    out = capsys.readouterr().out
    assert "skipped flash_mla at 1 of 2 shapes: FlashMLA's dense call takes pages of 64 tokens only" in out
    assert not [line for line in out.splitlines() if line.startswith("error ")]
    header = next(line for line in out.splitlines() if line.split()[:1] == ["b"])
    assert header.split()[:5] == ["b", "s_k", "h_q", "s_q", "page"]
    data = json.loads(json_path.read_text())
    assert [(r["name"], r["page_size"], "ms_median" in r) for r in data["records"]] == [
        ("flashmla", 16, True), ("flash_mla", 16, False), ("flashmla", 64, True), ("flash_mla", 64, True)]
    assert all(r["check_ok"] for r in data["records"] if r["name"] == "flashmla")
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["page_size"], r["skipped"]) for r in rows if r["name"] == "flash_mla"] == [
        ("16", "FlashMLA's dense call takes pages of 64 tokens only"), ("64", "")]


@pytest.mark.parametrize("gpu_name", ["Fake H200", "Fake H100"])
def test_profile_sparse_end_to_end_with_a_stand_in_gpu(monkeypatch, tmp_path, capsys, gpu_name):
    """cli → runner → report for sparse: µs, the shape columns, --check, the exports; on an H200
    FlashMLA's anchors as a column with the speed-up and the note that they come from another run."""
    small = shapes.SparseShape(**SMALL_SPARSE, s_q=2)
    monkeypatch.setattr(anchors, "SPARSE_FP8_H200_US", {small.key: 100.0})
    csv_path, json_path = tmp_path / "s.csv", tmp_path / "s.json"
    argv = ["profile", "sparse", "--quick", "--check", "--csv", str(csv_path), "--json", str(json_path)]
    assert _cli_with_a_stand_in_gpu(monkeypatch, argv, gpu=dict(FAKE_GPU, name=gpu_name)) == 0
    out = capsys.readouterr().out
    anchored = gpu_name == "Fake H200"
    assert "sparse decoding" in out and "flashmla" in out and "µs" in out and "topk" in out and "cos_diff" in out
    assert "656·distinct cache tokens" in out and "no FP8 matmul ceiling" in out
    header = next(line for line in out.splitlines() if "flashmla" in line and "p10–p90" in line)
    assert ("flash_mla" in header and "speed" in header) == anchored
    assert ("note flash_mla: anchors from another run, not measured in this one" in out) == anchored
    assert ("100.0" in out) == anchored
    data = json.loads(json_path.read_text())
    assert data["kind"] == "sparse" and data["config"]["baseline"] is None
    assert ceilings.NO_FP8_MATMUL in data["ceilings"]["notes"]
    ours = [r for r in data["records"] if r["name"] == "flashmla"]
    assert len(ours) == 2 and all(r["check_ok"] for r in ours)
    assert {r["name"] for r in data["records"]} == ({"flashmla", "flash_mla"} if anchored else {"flashmla"})
    assert all(("speedup" in r) == anchored for r in ours)
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["name"] == "flashmla" and int(rows[0]["seqlen"]) == 256 and int(rows[0]["topk"]) == 64


@pytest.mark.parametrize("q_dtype, q_text, q_bytes", [
    (None, "bf16", 2), ("bf16", "bf16", 2), ("fp8", "e4m3", 1),
])
def test_profile_fp8_end_to_end_with_a_stand_in_gpu(monkeypatch, tmp_path, capsys, q_dtype, q_text, q_bytes):
    """--dtype fp8 (--q-dtype) through the CLI: its programs prebuilt, the FP8 cache and q's dtype in
    the title, 576 bytes a token and q's own element size, FlashMLA n/a with the reason (exit 0), no
    FP8 ceiling said, the cache's and q's dtypes in every CSV and JSON row."""
    csv_path, json_path = tmp_path / "f.csv", tmp_path / "f.json"
    built = []
    profile_programs = build.profile_programs
    monkeypatch.setattr(build, "profile_programs", lambda *a: built.append(a) or profile_programs(*a))
    argv = ["profile", "--dtype", "fp8", "--seqlens", "128", "--heads", "16", "--s-q", "1,2", "--varlen", "off",
            "--baseline", "flash_mla", "--check", "--csv", str(csv_path), "--json", str(json_path)]
    assert _cli_with_a_stand_in_gpu(monkeypatch, argv + (["--q-dtype", q_dtype] if q_dtype else [])) == 0
    assert built == [("mla", "fp8", q_dtype, (), ())]
    out = capsys.readouterr().out
    assert f"MLA decoding, q {q_text}, FP8 cache (576 B/token, one scale), causal, h_kv 1" in out
    assert "skipped flash_mla at 2 of 2 shapes: FlashMLA has no dense FP8 decoding on Hopper" in out
    assert "no FP8 matmul ceiling" in out and "e = 2 (bf16/fp16 cache) or 1 (FP8 cache)" in out
    assert "e_q = 2 (bf16/fp16 q) or 1 (e4m3 q)" in out
    assert not [line for line in out.splitlines() if line.startswith("error ")]
    data = json.loads(json_path.read_text())
    q = q_dtype or "bf16"
    assert [(r["name"], r["dtype"], r["q_dtype"], "ms_median" in r) for r in data["records"]] == [
        ("flashmla", "fp8", q, True), ("flash_mla", "fp8", q, False)] * 2
    for r in data["records"]:         # the stand-in's 2 requests of 128 tokens; out in bf16
        assert r["bytes"] == 576 * 2 * 128 + 2 * r["s_q"] * 16 * (q_bytes * 576 + 2 * 512)
        assert r.get("check_ok", True) is True
    assert data["records"][0]["check_ok"] is True
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["name"], r["dtype"], r["q_dtype"]) for r in rows] == [
        ("flashmla", "fp8", q), ("flash_mla", "fp8", q)] * 2


def test_profile_torch_inputs_unavailable_exits_with_one_line(monkeypatch):
    monkeypatch.setattr(runner, "require_device", lambda config, need_hopper: FAKE_GPU)
    monkeypatch.setattr(targets.torch_drop_in, "torch_unavailable", lambda: "torch is not importable (stand-in)")
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", "--quick", "--inputs", "torch"])
    _assert_one_line_exit(excinfo, "--inputs torch", "torch is not importable (stand-in)")


def test_info_runs_anywhere(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "CuPy" in out and "NVRTC" in out and "compile cache" in out and "bfloat16" in out
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"versions", "gpus", "cache", "bfloat16", "pdl"} <= set(data)
    assert data["versions"]["cupy"] and data["versions"]["ml_dtypes"]


def test_help_and_version(capsys):
    for argv in (["--help"], ["compile", "--help"], ["profile", "--help"], ["info", "--help"], ["--version"]):
        with pytest.raises(SystemExit) as excinfo:
            cli.main(argv)
        assert excinfo.value.code == 0
    assert "--arch" in capsys.readouterr().out or True


def test_bad_arguments_exit_2():
    for argv in (["profile", "--heads", "0"], ["profile", "--batch", "x"]):
        with pytest.raises(SystemExit) as excinfo:
            cli.main(argv)
        assert excinfo.value.code == 2


def test_compile_takes_every_program_from_the_registry():
    from flashmla_cupy import programs
    found = build.collect_programs()
    names = [p.name for p in found]
    assert names and len(set(names)) == len(names)
    assert found == programs.all_programs()
    assert build.collect_programs("mla") == programs.mla_programs()
    assert all("attn" in p.name for p in build.collect_programs("attention"))
    assert build.filter_programs(found, ["metadata"]) == [p for p in found if "metadata" in p.name]
    assert build.short_kernel_name("flashmla::mla_combine_kernel<cutlass::bfloat16_t>") == \
        "mla_combine_kernel<bfloat16_t>"


def test_a_profile_prebuilds_the_programs_it_launches():
    names = {kind: [p.name for p in build.profile_programs(kind, "fp16")] for kind in ("mla", "sparse")}
    assert names == {"mla": ["splitkv_mla<fp16>", "mla_combine<fp16>", "mla_metadata"],
                     "sparse": ["splitkv_mla<fp8_sparse>", "splitkv_mla<fp8_sparse, alone>", "mla_combine<bf16>",
                                "mla_metadata"]}
    # sparse: the form for pairs of CTAs where h_q makes an even number of m-blocks, else CTAs alone
    forms = {heads: [p.name for p in build.profile_programs("sparse", "bf16", None, (), heads)][:-2]
             for heads in ((128,), (64, 16), (128, 32))}
    assert forms == {(128,): ["splitkv_mla<fp8_sparse>"], (64, 16): ["splitkv_mla<fp8_sparse, alone>"],
                     (128, 32): ["splitkv_mla<fp8_sparse>", "splitkv_mla<fp8_sparse, alone>"]}
    fp8 = build.profile_programs("mla", "fp8")        # the dense FP8 cache: its split-KV and narrow kernels, bf16 out
    assert [p.name for p in fp8] == ["splitkv_mla<fp8>", "fp8_narrow_mla", "mla_combine<bf16>", "mla_metadata"]
    assert [p.name for p in build.profile_programs("mla", "fp8", "fp8")][0] == "splitkv_mla<fp8q>"   # e4m3 q
    # one-token pages have a program of their own (the narrow kernel has forms for them)
    pages = {sizes: [p.name for p in build.profile_programs("mla", "bf16", None, sizes)][:2]
             for sizes in ((1,), (1, 64), (16,))}
    assert pages == {(1,): ["splitkv_mla<bf16, page 1>", "mla_combine<bf16>"],
                     (1, 64): ["splitkv_mla<bf16>", "splitkv_mla<bf16, page 1>"],
                     (16,): ["splitkv_mla<bf16>", "mla_combine<bf16>"]}
    assert [p.name for p in build.profile_programs("mla", "fp8", None, (1,))][:2] == ["splitkv_mla<fp8, page 1>",
                                                                                     "fp8_narrow_mla"]
    assert [p.name for p in build.profile_programs("mla", "fp8", "fp8", (1,))][0] == "splitkv_mla<fp8q, page 1>"
    assert build.profile_programs("attention") == build.collect_programs("attention")
    registry = build.collect_programs()
    assert all(p in registry for kind in ("mla", "sparse") for p in build.profile_programs(kind))
    assert all(p in registry for p in fp8)


def test_compile_list_without_gpu(capsys):
    assert cli.main(["compile", "--arch", "sm_90a", "--list"]) == 0
    assert "mla_metadata" in capsys.readouterr().out


def test_compile_a_small_program_then_hit_the_cache(monkeypatch, tmp_path, capsys):
    """A real NVRTC compile of a small kernel (about a second), no GPU."""
    monkeypatch.setenv("FLASHMLA_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    report_path = tmp_path / "kernels.json"
    only = ["--only", "mla_combine<bf16>"]
    assert cli.main(["compile", "--arch", "sm_90a", *only, "--json", str(report_path)]) == 0
    first = json.loads(report_path.read_text())["kernels"]
    assert len(first) == 1 and first[0]["registers"] > 0 and first[0]["from_cache"] is False
    assert first[0]["stack_bytes"] == 0 and first[0]["spill_stores"] in (0, -1)    # -1: no ptxas report
    assert cli.main(["compile", "--arch", "sm_90a", *only, "--json", str(report_path)]) == 0
    assert json.loads(report_path.read_text())["kernels"][0]["from_cache"] is True
    assert "mla_combine_kernel<bfloat16_t>" in capsys.readouterr().out


def test_compile_with_nothing_to_build():
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["compile", "--arch", "sm_90a", "--only", "no-such-kernel"])
    _assert_one_line_exit(excinfo, "no kernel programs")


def test_versions_without_gpu():
    v = env.versions()
    assert v["cupy"] and v["nvrtc"] and v["numpy"] and v["ml_dtypes"]
    assert "cutlass" in v and "cublas" in v


# --------------------------------------------------------------------------------------------
# On a GPU
# --------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_timing_and_ceilings_on_the_gpu():
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(1 << 20, dtype=cupy.float32)
    flush = timing.L2Flush(env.device_info(0)["l2_bytes"])
    samples = timing.time_cuda(lambda: x * 2, stream=stream, repeats=20, warmup=2, flush=flush)
    assert len(samples) == 20 and all(s > 0 for s in samples)
    samples = timing.time_cuda(lambda: x * 2, stream=stream, repeats=20, warmup=2,
                               flush=timing.L2Flush(env.device_info(0)["l2_bytes"], mode="read"))
    assert len(samples) == 20 and all(s > 0 for s in samples)
    graphed = timing.time_cuda(lambda: x * 2, stream=stream, repeats=20, warmup=2, flush=flush, graph=True)
    assert len(graphed) == 20
    assert ceilings.measure_copy(stream, 1 << 28, repeats=5) > 100        # GB/s
    if ceilings.cublas_status() is None:
        tflops, how = ceilings.measure_matmul(stream, 2048, repeats=3)
        assert tflops > 1 and "2048" in how
        tflops, how = ceilings.measure_matmul(stream, 1024, repeats=4, dtype="fp32")
        assert tflops > 0.1 and "fp32" in how


@pytest.mark.gpu
def test_baseline_on_the_gpu_matches_the_reference():
    import cupy

    if ceilings.cublas_status():
        pytest.skip(ceilings.cublas_status())
    shape = shapes.MLAShape(3, 200, 16, 2, True, (150, 260, 2))
    inp = inputs.make_mla_inputs(shape, seed=1)
    out, lse = baselines.mla_decode(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, causal=True)
    ref_out, ref_lse = reference.mla_decode(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512,
                                            causal=True)
    assert isinstance(out, cupy.ndarray)
    assert reference.cos_diff(out, ref_out) < 1e-5 and reference.cos_diff(lse, ref_lse) < 1e-5


@pytest.mark.hopper
@pytest.mark.parametrize("argv", [
    ["--inputs", "torch"],
    ["--baseline", "flash_mla"],
    ["--inputs", "torch", "--baseline", "flash_mla"],
    ["--inputs", "torch", "--baseline", "flash_mla", "--graph"],
    ["--value-checks", "sync"],
    ["--value-checks", "off", "--graph"],
], ids=["torch", "flash_mla", "torch-flash_mla", "torch-flash_mla-graph", "sync", "off-graph"])
def test_profile_inputs_value_checks_and_flash_mla_on_hopper(tmp_path, argv):
    """A tiny run of each option: torch tensors through the drop-in, FlashMLA's own call beside the
    default one (skipped here, with the reason, where torch or flash_mla is not importable)."""
    main = targets.MAIN_MLA_TARGETS["torch" if "torch" in argv else "cupy"]
    baseline = "flash_mla" if "flash_mla" in argv else None
    for name in (main, baseline):
        why = name and targets.MLA_TARGETS[name].requires()
        if why:
            pytest.skip(f"{name}: {why}")
    path = tmp_path / "q.json"
    rc = cli.main(["profile", "--heads", "64", "--seqlens", "1024", "--s-q", "2", "--varlen", "on",
                   "--batch", "4", "--repeats", "10", "--warmup", "2", "--no-ceilings", "--check",
                   "--json", str(path), *argv])
    data = json.loads(path.read_text())
    assert all("error" not in r and r["check_ok"] for r in data["records"]), data["records"]
    assert {r["name"] for r in data["records"]} == {main} | ({baseline} if baseline else set())
    assert all(r["ms_median"] > 0 for r in data["records"])
    if baseline:
        main_rows = [r for r in data["records"] if r["name"] == main]
        assert all(r["speedup_vs"] == "flash_mla" and r["speedup"] > 0 for r in main_rows)
    mode = argv[argv.index("--value-checks") + 1] if "--value-checks" in argv else "async"
    assert data["method"]["value_checks"] == data["config"]["value_checks"] == mode
    assert f"current mode ({mode}" in data["method"]["timed"]
    assert rc == 0


@pytest.mark.hopper
def test_profile_sparse_on_hopper(tmp_path):
    """A small sparse run on the GPU: the call with indices against the float64 reference."""
    path = tmp_path / "s.json"
    rc = cli.main(["profile", "sparse", "--batch", "3", "--heads", "64", "--s-q", "2", "--seqlens", "4096",
                   "--topk", "512", "--repeats", "10", "--warmup", "2", "--no-ceilings", "--check",
                   "--json", str(path)])
    data = json.loads(path.read_text())
    ours = [r for r in data["records"] if r["name"] == "flashmla"]
    assert len(ours) == 1 and all("error" not in r and r["check_ok"] for r in ours), ours
    assert ours[0]["ms_median"] > 0 and ours[0]["topk"] == 512
    assert rc == 0


@pytest.mark.hopper
def test_profile_page_sizes_on_hopper(tmp_path):
    """The default call on caches of 1- to 512-token pages against the float64 reference; FlashMLA
    (where importable) n/a beside it at every size but 64."""
    baseline = "cupy" if targets.MLA_TARGETS["flash_mla"].requires() else "flash_mla"
    path = tmp_path / "p.json"
    rc = cli.main(["profile", "--heads", "64", "--seqlens", "1024", "--s-q", "2", "--varlen", "on", "--batch", "4",
                   "--page-size", "1,16,64,128,512", "--repeats", "10", "--warmup", "2", "--no-ceilings", "--check",
                   "--baseline", baseline, "--json", str(path)])
    data = json.loads(path.read_text())
    main = [r for r in data["records"] if r["name"] == "flashmla"]
    assert [r["page_size"] for r in main] == [1, 16, 64, 128, 512]
    assert all("error" not in r and r["check_ok"] and r["ms_median"] > 0 for r in main), main
    others = [r for r in data["records"] if r["name"] == baseline]
    assert [r["page_size"] for r in others if "skipped" not in r] == ([64] if baseline == "flash_mla"
                                                                      else [1, 16, 64, 128, 512])
    assert rc == 0


@pytest.mark.hopper
@pytest.mark.parametrize("argv", [[], ["--q-dtype", "fp8"], ["--q-dtype", "fp8", "--inputs", "torch"]],
                         ids=["bf16-q", "e4m3-q", "e4m3-q-torch"])
def test_profile_fp8_on_hopper(tmp_path, argv):
    """The default call over the dense FP8 cache (bf16 or e4m3 q; CuPy arrays or torch tensors)
    against the float64 reference at two page sizes, 576 bytes a token, q at its own element size;
    the CuPy baseline n/a beside it."""
    main_t = targets.MAIN_MLA_TARGETS["torch" if "torch" in argv else "cupy"]
    why = targets.MLA_TARGETS[main_t].requires()
    if why:
        pytest.skip(f"{main_t}: {why}")
    q_dtype, q_bytes = ("fp8", 1) if "fp8" in argv else ("bf16", 2)
    path = tmp_path / "f.json"
    rc = cli.main(["profile", "--dtype", "fp8", "--heads", "64", "--seqlens", "1024", "--s-q", "2", "--varlen", "on",
                   "--batch", "4", "--page-size", "16,64", "--repeats", "10", "--warmup", "2", "--no-ceilings",
                   "--check", "--baseline", "cupy", "--json", str(path), *argv])
    data = json.loads(path.read_text())
    main = [r for r in data["records"] if r["name"] == main_t]
    assert [r["page_size"] for r in main] == [16, 64]
    assert all("error" not in r and r["check_ok"] and r["ms_median"] > 0 for r in main), main
    assert all((r["dtype"], r["q_dtype"]) == ("fp8", q_dtype) for r in main)
    assert all(r["bytes"] == 576 * r["total_seqlen"] + 4 * 2 * 64 * (q_bytes * 576 + 2 * 512) for r in main)
    assert all(r["skipped"] for r in data["records"] if r["name"] == "cupy")
    assert rc == 0


@pytest.mark.hopper
def test_profile_quick_on_hopper(tmp_path, capsys):
    path = tmp_path / "q.json"
    rc = cli.main(["profile", "--heads", "16", "--seqlens", "1024", "--s-q", "1", "--varlen", "off",
                   "--batch", "4", "--repeats", "10", "--check", "--baseline", "cupy", "--json", str(path)])
    data = json.loads(path.read_text())
    main = [r for r in data["records"] if r["name"] == "flashmla"]
    assert main and all("error" not in r for r in main), main
    assert all(r["check_ok"] for r in main)
    assert rc == 0
    # NVML's clocks where the machine has it (cuda-bindings 12.9+ or nvidia-ml-py): read, not made up
    if not data["method"]["clocks"].startswith("not sampled"):
        assert any(n.startswith("matmul ceiling at SM ") for n in data["ceilings"]["notes"]), data["ceilings"]
        for r in data["records"]:
            assert 100 <= r["sm_clock_min_mhz"] <= r["sm_clock_mhz"] <= data["environment"]["gpu"]["sm_clock_max_mhz"]
            assert r["clock_samples"] >= 2 and 0 < r["power_w"] < 2000 and 0 <= r["power_capped"] <= 1
