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

import ml_dtypes
import numpy as np
import pytest

from flashmla_cupy import baselines, cli, reference
from flashmla_cupy.profiler import build, ceilings, env, inputs, report, runner, shapes, targets, timing

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

def _fixed(b, s, h_q, s_q, h_kv=1, dtype="bf16"):
    return shapes.MLAShape(b, s, h_q, s_q, False, (s,) * b, h_kv=h_kv, dtype=dtype)


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
    assert "s_k=300~" in s.label()


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


# --------------------------------------------------------------------------------------------
# The profile loop, end to end on NumPy
# --------------------------------------------------------------------------------------------

class FakeSession:
    """Stands in for ``runner.CudaSession``: calls the target like the timer does, reports fixed
    times (the baseline 10x slower) and the anchor run's ceilings."""

    def __init__(self, config):
        self.config, self.flush, self.calls = config, None, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def ceilings(self):
        return ceilings.Ceilings(ANCHOR_COPY_GBPS, ANCHOR_MATMUL_TFLOPS, "fake copy", "fake matmul")

    def time(self, fn):
        fn()
        self.calls += 1
        scale = 10.0 if self.current == "cupy" else 1.0
        return [scale * x for x in (0.20, 0.21, 0.22, 0.25, 0.19)]

    def free(self):
        pass


def _numpy_mla_workload(session: FakeSession, broken: bool = False):
    def tracked(name, setup):
        def wrapped(inp):
            session.current = name
            if broken and name == "flashmla":
                raise RuntimeError("kernel exploded\nsecond line")
            return setup(inp)
        return wrapped

    table = {
        "flashmla": targets.Target("flashmla", "stand-in", tracked("flashmla", targets.setup_cupy_baseline)),
        "cupy": targets.Target("cupy", "plain baseline", tracked("cupy", targets.setup_cupy_baseline)),
    }
    return runner.Workload("mla", table, functools.partial(inputs.make_mla_inputs, xp=np),
                           runner._mla_reference, runner._mla_compare, shapes.mla_flops, shapes.mla_bytes,
                           runner._mla_fields)


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


def test_attention_run_on_numpy():
    """The attention sweep's loop, checks and table, with NumPy stand-ins for the two kernels."""
    from rich.console import Console

    def setup(inp):
        def run():
            return reference.attention(inp.q, inp.k, inp.v, causal=inp.shape.causal)[0].astype(np.float32)
        return targets.Prepared(run, run())

    table = {n: targets.Target(n, "", setup) for n in ("flash_attn_minimal", "manual")}
    work = runner.Workload("attention", table, functools.partial(inputs.make_attention_inputs, xp=np),
                           runner._attention_reference, runner._attention_compare, shapes.attention_flops,
                           shapes.attention_bytes, runner._attention_fields)
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
                "speedup", "cos_diff_out", "max_abs_lse", "copy_gbps_ceiling", "varlen", "s_q"):
        assert col in header, col
    assert "shape_index" not in header
    assert len(rows) == 16 and {r["name"] for r in rows} == {"flashmla", "cupy"}
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
    for inputs, mode, words in (("cupy", "async", "CuPy arrays"), ("torch", "sync", "torch tensors")):
        config = runner.RunConfig(targets=[targets.MAIN_MLA_TARGETS[inputs]], inputs=inputs, value_checks=mode)
        method = runner.method_description(config, 50 << 20, "mla")
        assert "default call" in method["timed"] and words in method["timed"] and f"'{mode}'" in method["timed"]
        assert (method["inputs"], method["value_checks"]) == (inputs, mode)


def test_torch_and_flash_mla_targets_say_why_they_cannot_run(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name == "flash_mla":
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delitem(sys.modules, "flash_mla", raising=False)
    for name in ("flashmla_torch", "flash_mla"):
        why = targets.MLA_TARGETS[name].requires()
        assert why and "torch is not importable" in why, why


@pytest.mark.parametrize("argv, main, baseline", [
    ([], "flashmla", None),
    (["--inputs", "torch"], "flashmla_torch", None),
    (["--baseline", "flash_mla"], "flashmla", "flash_mla"),
    (["--inputs", "torch", "--baseline", "flash_mla", "--value-checks", "off"], "flashmla_torch", "flash_mla"),
])
def test_profile_options_choose_targets_and_mode(monkeypatch, argv, main, baseline):
    from flashmla_cupy import errors
    seen = {}

    def stop(config, need_hopper):
        seen["config"] = config
        raise env.NoGPU("stand-in: stop after parsing")

    monkeypatch.setattr(runner, "require_device", stop)
    monkeypatch.setattr(errors, "_mode", errors.value_check_mode())     # restored after the test
    with pytest.raises(SystemExit):
        cli.main(["profile", "--quick", *argv])
    config = seen["config"]
    assert config.targets == [main] + ([baseline] if baseline else []) and config.baseline == baseline
    assert config.value_checks == ("off" if "off" in argv else "async")


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
    for argv in (["profile"], [], ["--quick"], ["profile", "attention", "--quick"]):
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


def test_profile_on_non_hopper_exits(monkeypatch):
    monkeypatch.setattr(env, "gpu_count", lambda: 1)
    monkeypatch.setattr(env, "device_info", lambda i: {"name": "Fake A100", "compute_capability": "8.0"})
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", "--quick"])
    _assert_one_line_exit(excinfo, "Hopper", "Fake A100")


def test_profile_end_to_end_with_a_stand_in_gpu(monkeypatch, tmp_path, capsys):
    """cli → runner → report with the session and the kernels replaced (NumPy underneath)."""
    monkeypatch.setenv("COLUMNS", "250")
    fake_gpu = {"name": "Fake H100", "sm_count": 132, "arch": "sm_90a", "compute_capability": "9.0",
                "memory_bytes": 80 << 30, "l2_bytes": 50 << 20}
    monkeypatch.setattr(runner, "require_device", lambda config, need_hopper: fake_gpu)
    monkeypatch.setattr(env, "environment", lambda device: {"versions": {}, "gpu": fake_gpu, "pdl": "on"})
    monkeypatch.setattr(build, "prebuild", lambda *a, **k: None)
    sessions = []

    def fake_workload():
        session = FakeSession(None)
        sessions.append(session)
        return _numpy_mla_workload(session)

    def fake_run(work, shape_list, config, **kw):
        small = [dataclasses.replace(s, batch=2, seqlens=s.seqlens[:2]) for s in shape_list]
        return real_run(work, small, config, session=sessions[-1], **kw)

    real_run = runner.run
    monkeypatch.setattr(runner, "mla_workload", fake_workload)
    monkeypatch.setattr(runner, "run", fake_run)
    csv_path, json_path, png = tmp_path / "a.csv", tmp_path / "a.json", tmp_path / "a.png"
    argv = ["profile", "--seqlens", "128,256", "--heads", "16", "--s-q", "1", "--baseline", "cupy",
            "--check", "--csv", str(csv_path), "--json", str(json_path)]
    if report.matplotlib_status() is None:
        argv += ["--plot", str(png)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Fake H100" in out and "flashmla" in out and "Ceiling" in out and "cos_diff" in out
    assert csv_path.read_text().startswith("name,batch,seqlen,head,bw,")
    data = json.loads(json_path.read_text())
    assert len(data["records"]) == 8 and data["environment"]["gpu"]["name"] == "Fake H100"
    assert data["config"]["check"] is True
    if report.matplotlib_status() is None:
        assert png.read_bytes()[:4] == b"\x89PNG"


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
    for argv in (["profile", "--heads", "0"], ["profile", "--batch", "x"], ["profile", "--dtype", "fp8"]):
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
@pytest.mark.parametrize("argv", [["--inputs", "torch"], ["--baseline", "flash_mla"]], ids=["torch", "flash_mla"])
def test_profile_torch_inputs_and_flash_mla_baseline_on_hopper(tmp_path, argv):
    if targets.MLA_TARGETS[argv[1] if argv[0] == "--baseline" else "flashmla_torch"].requires():
        pytest.skip(targets.MLA_TARGETS[argv[1] if argv[0] == "--baseline" else "flashmla_torch"].requires())
    path = tmp_path / "q.json"
    rc = cli.main(["profile", "--heads", "64", "--seqlens", "1024", "--s-q", "2", "--varlen", "off",
                   "--batch", "4", "--repeats", "10", "--check", "--json", str(path), *argv])
    data = json.loads(path.read_text())
    names = {r["name"] for r in data["records"]}
    assert all("error" not in r and r["check_ok"] for r in data["records"]), data["records"]
    if argv[0] == "--baseline":
        assert names == {"flashmla", "flash_mla"}
        assert all(r["speedup_vs"] == "flash_mla" for r in data["records"] if r["name"] == "flashmla")
    else:
        assert names == {"flashmla_torch"}
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
