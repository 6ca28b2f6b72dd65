"""Two versions of the package timed against each other with the profiler, alternated.

    python tools/ab_profile.py A B [--rounds 3] [--dtype bf16,fp8,sparse] [--out DIR] [-- PROFILE ARGS]

A and B: directories holding a copy of the package (``flashmla_cupy/`` and ``cuda_src/``: a ``git
worktree``, or ``git archive REV flashmla_cupy cuda_src | tar -x -C DIR``), or git revisions of
this checkout, which are exported so. Each round profiles A, B, B, A for every dtype, each in a
fresh process started in its tree (``python -m flashmla_cupy profile --dtype D --csv ...``, or for
the dtype ``sparse`` ``profile sparse``, its production rows; the profile arguments after ``--``,
by default ``--varlen off --no-ceilings --repeats 20``, which sparse takes too), so
that a drift of the clocks or the power cap during the run falls on both. Both trees share one
cubin cache: programs are keyed by their sources. A GPU with the kernels' cubins at hand runs a
bf16 or fp8 profile in about 4 s, plus the process start.

Printed per dtype, page size and group of query rows (h_q·s_q): the geomean over the group's rows
of B's time over A's (each the geomean of that target's medians over the rounds), and A's last
round over its first, the noise to read it against; then the rows that moved most. Under --out:
every profile's CSV and log, and ``summary.txt``.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE_ARGS = ["--varlen", "off", "--no-ceilings", "--repeats", "20"]
SPARSE = "sparse"          # a --dtype entry: profile sparse
ROW_GROUPS = ((16, "<= 16"), (32, "17-32"), (64, "33-64"), (128, "65-128"), (math.inf, "> 128"))


def tree_of(spec: str, scratch: Path) -> Path:
    """``spec`` itself if it is a directory holding the package, else git revision ``spec``
    of this checkout exported into ``scratch``."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "flashmla_cupy").is_dir() or not (path / "cuda_src").is_dir():
            raise SystemExit(f"{spec}: a directory, but without flashmla_cupy/ and cuda_src/")
        return path.resolve()
    dest = scratch / spec.replace("/", "_")
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", spec, "flashmla_cupy", "cuda_src"],
                             capture_output=True)
    if archive.returncode:
        raise SystemExit(f"{spec}: neither a directory nor a git revision of {REPO} "
                         f"({archive.stderr.decode().strip()})")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def schedule(rounds: int, dtypes: list[str]) -> list[tuple[int, str, str]]:
    """(round, "A" or "B", dtype) in the order they run: A, B, B, A each round, every dtype."""
    return [(r, who, dtype) for r in range(rounds) for who in ("A", "B", "B", "A") for dtype in dtypes]


def profile_words(dtype: str, profile_args: list[str]) -> list[str]:
    """The profiler's command line for one dtype, from ``profile`` on."""
    kind = ["sparse"] if dtype == SPARSE else ["--dtype", dtype]
    return ["profile", *kind, *profile_args]


def profile_command(tree: Path, dtype: str, profile_args: list[str], csv_path: Path) -> list[str]:
    # run with the tree as working directory: -m puts it first on sys.path, before any installed copy
    return [sys.executable, "-m", "flashmla_cupy", *profile_words(dtype, profile_args), "--csv", str(csv_path)]


def run_profile(tree: Path, dtype: str, profile_args: list[str], csv_path: Path, log_path: Path,
                timeout: float) -> str | None:
    """One profile of ``tree``; None, or why it gave no CSV."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    try:
        with log_path.open("w") as log:
            done = subprocess.run(profile_command(tree, dtype, profile_args, csv_path), cwd=tree, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"no result within {timeout:g} s (a hang?)"
    if done.returncode or not csv_path.exists():
        return f"exit status {done.returncode} (see {log_path})"
    return None


def read_times(csv_path: Path) -> dict[tuple, float]:
    """The default call's median time (ms) per shape: (page size, s_k, h_q, s_q, varlen, batch,
    topk); sparse rows have no page size (64) and no varlen, MLA rows no topk."""
    times = {}
    with csv_path.open() as f:
        for r in csv.DictReader(f):
            if r["name"] != "flashmla" or r.get("error") or not r.get("ms_median"):
                continue
            key = (int(r.get("page_size") or 64), int(r["seqlen"]), int(r["head"]), int(r["s_q"]), r.get("varlen", ""),
                   int(r["batch"]), r.get("topk", ""))
            times[key] = float(r["ms_median"])
    return times


def row_group(key: tuple) -> str:
    rows = key[2] * key[3]
    return next(name for bound, name in ROW_GROUPS if rows <= bound)


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan


def summarize(runs: list[tuple[int, str, str, dict]]) -> list[str]:
    """Lines of the summary from (round, who, dtype, times) of every profile that ran."""
    lines = []
    for dtype in dict.fromkeys(d for _, _, d, _ in runs):
        a = [t for _, who, d, t in runs if d == dtype and who == "A"]
        b = [t for _, who, d, t in runs if d == dtype and who == "B"]
        if not a or not b:
            lines.append(f"{dtype}: no profile of {'A' if not a else 'B'} finished")
            continue
        shapes = sorted(set.intersection(*(set(t) for t in a + b)))
        ratio = {k: geomean(t[k] for t in b) / geomean(t[k] for t in a) for k in shapes}
        noise = {k: a[-1][k] / a[0][k] for k in shapes}
        lines.append(f"{dtype}: {len(a)} profiles of A, {len(b)} of B, {len(shapes)} shapes; "
                     f"B / A (A's last / first)")
        groups = defaultdict(list)
        for k in shapes:
            groups[(k[0], row_group(k))].append(k)
        order = [name for _, name in ROW_GROUPS]
        for page, group in sorted(groups, key=lambda g: (g[0], order.index(g[1]))):
            keys = groups[(page, group)]
            lines.append(f"  page {page:>4}, rows {group:>6}: {geomean(ratio[k] for k in keys):.4f} "
                         f"({geomean(noise[k] for k in keys):.4f}), {len(keys)} shapes")
        lines.append(f"  all: {geomean(ratio.values()):.4f} ({geomean(noise.values()):.4f})")
        moved = sorted(shapes, key=lambda k: ratio[k])
        for k in moved[:3] + moved[-3:] if len(moved) > 6 else moved:
            page, s_k, h_q, s_q, varlen, batch, topk = k
            shape = f"b {batch} s_k {s_k} h_q {h_q} s_q {s_q} topk {topk}" if dtype == SPARSE else \
                f"page {page} s_k {s_k} h_q {h_q} s_q {s_q} varlen {varlen}"
            lines.append(f"    {shape}: "
                         f"A {geomean(t[k] for t in a) * 1e3:.1f} us, B {geomean(t[k] for t in b) * 1e3:.1f} us, "
                         f"{ratio[k]:.4f}")
    return lines


def compare(tree_a: Path, tree_b: Path, dtypes: list[str], rounds: int, profile_args: list[str], out: Path,
            timeout: float, run=run_profile) -> list[str]:
    """Run the alternated profiles and return the summary (also written to out/summary.txt)."""
    out.mkdir(parents=True, exist_ok=True)
    trees = {"A": tree_a, "B": tree_b}
    runs = []
    plan = schedule(rounds, dtypes)
    for n, (rnd, who, dtype) in enumerate(plan, 1):
        stem = out / f"{n:02d}_{who}_{dtype}"
        why = run(trees[who], dtype, profile_args, stem.with_suffix(".csv"), stem.with_suffix(".log"), timeout)
        print(f"[{n}/{len(plan)}] round {rnd + 1}, {who} {dtype}: {why or 'ok'}", flush=True)
        if why is None:
            runs.append((rnd, who, dtype, read_times(stem.with_suffix(".csv"))))
    commands = [" ".join(profile_words(dtype, profile_args)) for dtype in dtypes]
    lines = [f"A = {tree_a}", f"B = {tree_b}", *commands, *summarize(runs)]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    profile_args = DEFAULT_PROFILE_ARGS
    if "--" in argv:
        argv, profile_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="the reference: a directory with the package, or a git revision")
    ap.add_argument("b", help="the version measured against it (the same forms)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of A, B, B, A (default 3)")
    ap.add_argument("--dtype", default="bf16,fp8",
                    help=f"profile --dtype values, or {SPARSE} (profile sparse), comma separated (default bf16,fp8)")
    ap.add_argument("--out", type=Path, default=Path("ab_profile"),
                    help="CSVs, logs and summary.txt (default ./ab_profile)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one profile may take (default 300)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1; got {args.rounds}")
    with tempfile.TemporaryDirectory(prefix="ab_profile_") as scratch:
        tree_a, tree_b = (tree_of(spec, Path(scratch)) for spec in (args.a, args.b))
        lines = compare(tree_a, tree_b, args.dtype.split(","), args.rounds, profile_args, args.out, args.timeout)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
