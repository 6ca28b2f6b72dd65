"""tools/ab_profile.py, the alternated comparison of two versions with the profiler (CPU: the
profiles are stand-ins that write the profiler's own CSV)."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

from flashmla_cupy.profiler import report, runner, shapes
from flashmla_cupy.profiler.ceilings import Ceilings

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ab_profile", REPO / "tools" / "ab_profile.py")
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)

GRID = shapes.mla_grid(batches=(2,), seqlens=(100, 200), heads=(16, 64, 128), s_qs=(1, 2), varlens=(False,))


def write_profile(path: Path, time_of) -> None:
    """The profiler's CSV of GRID with ``time_of(shape)`` ms for the default call (and a baseline row,
    which the tool must skip)."""
    records = []
    for shape in GRID:
        fields = runner._mla_fields(shape)
        records.append({"name": "flashmla", **fields, "ms_median": time_of(shape)})
        records.append({"name": "cupy", **fields, "ms_median": 100.0})
    report.write_csv(path, records, Ceilings())


def test_rounds_alternate_a_b_b_a_for_every_dtype():
    assert ab.schedule(2, ["bf16", "fp8"]) == [
        (r, who, d) for r in (0, 1) for who in "ABBA" for d in ("bf16", "fp8")]


def test_groups_of_query_rows():
    assert [ab.row_group((64, 4096, h, s, "False")) for h, s in ((16, 1), (16, 2), (64, 1), (64, 2), (128, 2))] == \
        ["<= 16", "17-32", "33-64", "65-128", "> 128"]


def test_compare_reads_the_profilers_csv_and_reports_b_over_a(tmp_path):
    """B 1 % faster on the rows with more than 64 query rows, the same elsewhere; A's rounds drift by
    0.5 %: the summary says so per group, and the run went A, B, B, A."""
    order = []

    def fake_run(tree, dtype, profile_args, csv_path, log_path, timeout):
        drift = 1.0 + 0.005 * sum(1 for name, d in order if name == "a" and d == dtype)   # A: 1, 1.005, ...
        order.append((tree.name, dtype))

        def time_of(shape):
            if tree.name == "a":
                return 0.1 * shape.h_q * shape.s_q * drift
            return 0.1 * shape.h_q * shape.s_q * (0.99 if shape.h_q * shape.s_q > 64 else 1.0)
        write_profile(csv_path, time_of)
        log_path.write_text("ok\n")
        return None

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    lines = ab.compare(tmp_path / "a", tmp_path / "b", ["bf16"], 2, ["--varlen", "off"], tmp_path / "out",
                       timeout=1, run=fake_run)
    assert [name for name, _ in order] == list("abbaabba")
    assert (tmp_path / "out" / "summary.txt").read_text().splitlines() == lines
    assert lines[2] == "profile --dtype bf16 --varlen off"          # what ran, after the trees
    text = "\n".join(lines)
    assert "bf16: 4 profiles of A, 4 of B, 12 shapes" in text
    by_group = {line.split(":")[0].strip(): line for line in lines if line.startswith("  page")}
    b_over_a = {g: float(line.split(": ")[1].split()[0]) for g, line in by_group.items()}
    assert set(b_over_a) == {"page   64, rows  <= 16", "page   64, rows  17-32", "page   64, rows  33-64",
                             "page   64, rows 65-128", "page   64, rows  > 128"}
    a_mean = (1.0 * 1.005 * 1.01 * 1.015) ** 0.25     # A's four profiles
    for group, ratio in b_over_a.items():
        want = (0.99 if group.endswith(("65-128", "> 128")) else 1.0) / a_mean
        assert ratio == pytest.approx(want, abs=5e-5), group
    noise = float(by_group["page   64, rows  <= 16"].split("(")[1].split(")")[0])
    assert noise == pytest.approx(1.015, abs=5e-5)


def test_a_profile_that_fails_is_reported_and_left_out(tmp_path):
    def fake_run(tree, dtype, profile_args, csv_path, log_path, timeout):
        if tree.name == "b":
            return "exit status 1"
        write_profile(csv_path, lambda shape: 1.0)
        return None

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    lines = ab.compare(tmp_path / "a", tmp_path / "b", ["fp8"], 1, [], tmp_path / "out", timeout=1, run=fake_run)
    assert lines[-1] == "fp8: no profile of B finished"


def test_profiles_run_in_their_tree(tmp_path):
    cmd = ab.profile_command(tmp_path, "fp8", ["--quick"], tmp_path / "x.csv")
    assert cmd[1:] == ["-m", "flashmla_cupy", "profile", "--dtype", "fp8", "--quick", "--csv",
                       str(tmp_path / "x.csv")]


def test_sparse_runs_profile_sparse_and_keys_its_rows_by_batch_and_topk(tmp_path):
    cmd = ab.profile_command(tmp_path, "sparse", ["--repeats", "20"], tmp_path / "x.csv")
    assert cmd[3:6] == ["profile", "sparse", "--repeats"] and "--dtype" not in cmd
    rows = shapes.sparse_grid((), (), (), (), ())
    records = [{"name": "flashmla", **runner._sparse_fields(shape), "ms_median": 0.1 * (i + 1)}
               for i, shape in enumerate(rows)]
    report.write_csv(tmp_path / "s.csv", records, Ceilings())
    times = ab.read_times(tmp_path / "s.csv")
    assert len(times) == len(rows)                  # b 2, 64, 74 and 128 of the same shape stay apart
    assert {(k[5], k[6]) for k in times} == {(shape.batch, str(shape.topk)) for shape in rows}


def test_trees_are_directories_with_the_package_or_git_revisions(tmp_path):
    with pytest.raises(SystemExit, match="without flashmla_cupy/ and cuda_src/"):
        ab.tree_of(str(tmp_path), tmp_path / "scratch")
    with pytest.raises(SystemExit, match="neither a directory nor a git revision"):
        ab.tree_of("no-such-revision-here", tmp_path / "scratch")
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                                     capture_output=True).returncode:
        pytest.skip("not a git checkout: no revision to export")
    tree = ab.tree_of("HEAD", tmp_path / "scratch")
    assert (tree / "flashmla_cupy" / "mla.py").is_file() and (tree / "cuda_src" / "mla").is_dir()
    assert ab.tree_of(str(tree), tmp_path / "other") == tree.resolve()


def test_usage_errors():
    with pytest.raises(SystemExit):
        ab.main(["a"])
    with pytest.raises(SystemExit):
        ab.main(["a", "b", "--rounds", "0"])
