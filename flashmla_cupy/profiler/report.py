"""Showing and exporting results: the rich header and table, CSV, JSON, a matplotlib plot.

CSV: one row per (shape, target). The seed benchmark's columns come first,
``name,batch,seqlen,head,bw`` (target, batch, mean cache length, query heads, GB/s), so its
``visualize.py`` reads our files; every other number follows (``CSV_COLUMNS``).
JSON: ``{"tool", "kind", "created", "environment", "ceilings", "method", "config", "records"}``
with every number; non-finite floats are written as ``null``.
"""
from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

from .ceilings import Ceilings
from .clocks import clock_cell
from .shapes import PAGE_BLOCK

SEED_COLUMNS = ["name", "batch", "seqlen", "head", "bw"]
CSV_COLUMNS = SEED_COLUMNS + [
    # shape
    "mean_seqlen", "seqlen_mean", "total_seqlen", "max_seqlen", "h_q", "h_kv", "s_q", "varlen",
    "causal", "dtype", "q_dtype", "d", "dv", "page_size", "s_k", "topk", "heads", "head_dim",
    # time (ms)
    "ms_median", "ms_p10", "ms_p90", "ms_q1", "ms_q3", "ms_mean", "ms_std", "ms_min", "ms_max", "n_runs",
    # rates and roofs
    "tflops", "gbps", "flops", "bytes", "frac_copy_bw", "frac_matmul", "bound", "roof_fraction",
    "t_memory_ms", "t_compute_ms", "speedup", "speedup_vs",
    # clocks during the timed runs (NVML)
    "sm_clock_mhz", "sm_clock_min_mhz", "power_w", "power_capped", "thermal_slowdown", "clock_samples",
    # --check
    "cos_diff_out", "max_abs_out", "cos_diff_lse", "max_abs_lse", "check_ok",
    # context
    "graph", "copy_gbps_ceiling", "matmul_tflops_ceiling", "error", "skipped", "notes",
]

PLOT_MISSING = ("--plot needs matplotlib, which is not installed: "
                "pip install 'flashmla-cupy[plot]' (or pip install matplotlib)")

OUT_AND_LSE_KINDS = ("mla", "sparse")     # their targets return (out, lse): both are checked

FORMULAS = {
    "mla": "FLOPs = 2·s_q·Σseqlen·h_q·(576+512); "
           "bytes = e·Σseqlen·h_kv·576 + e_q·b·s_q·h_q·576 + 2·b·s_q·h_q·512, e = 2 (bf16/fp16 cache) or 1 "
           "(FP8 cache), e_q = 2 (bf16/fp16 q) or 1 (e4m3 q); "
           "bound: larger of bytes/copy-ceiling and FLOPs/matmul-ceiling",
    "sparse": "upstream FlashMLA's tests/lib.py: FLOPs = 2·h_q·(b·s_q·topk)·(576+512); "
              "bytes = 2·b·s_q·h_q·(576+512) (q, out) + 656·distinct cache tokens the indices name; "
              "bound: larger of bytes/copy-ceiling and FLOPs/matmul-ceiling",
    "attention": "FLOPs = 4·B·H·N²·d (halved if causal); bytes = 4·(4·B·H·N·d), float32; "
                 "bound: larger of bytes/copy-ceiling and FLOPs/fp32-matmul-ceiling",
}


# --------------------------------------------------------------------------------------------
# Formatting helpers (pure)
# --------------------------------------------------------------------------------------------

def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fmt_ms(x) -> str:
    if not _num(x):
        return "–"
    return f"{x:.3f}" if x < 100 else f"{x:.1f}"


def fmt_us(ms) -> str:
    return f"{1e3 * ms:.1f}" if _num(ms) else "–"


def fmt_pct(x) -> str:
    return f"{100 * x:.0f}%" if _num(x) else "–"


def fmt_sci(x) -> str:
    if x == math.inf:
        return "inf"
    return f"{x:.1e}" if _num(x) else "–"


def roof_style(frac) -> str:
    if not _num(frac):
        return ""
    return "green" if frac >= 0.7 else "yellow" if frac >= 0.4 else "red"


def bound_cell(rec: dict) -> str:
    """``memory 79%``: the roof that bounds the shape and how close the measured time comes to it."""
    kind, frac = rec.get("bound"), rec.get("roof_fraction")
    if not kind or kind == "?":
        return "–"
    style = roof_style(frac)
    text = f"{kind:<7} {fmt_pct(frac):>4}"
    return f"[{style}]{text}[/]" if style else text


def describe_ceilings(c: Ceilings) -> list[str]:
    lines = []
    if c.copy_gbps:
        lines.append(f"copy {c.copy_gbps:,.0f} GB/s ({c.copy_method})")
    if c.matmul_tflops:
        lines.append(f"matmul {c.matmul_tflops:,.0f} TFLOP/s ({c.matmul_method})")
    lines += c.notes
    return lines


# --------------------------------------------------------------------------------------------
# Header and table (rich)
# --------------------------------------------------------------------------------------------

def header_lines(env: dict, method: dict | None, *, kind: str, seed: int | None,
                 config: dict | None = None) -> list[tuple[str, str]]:
    """``(label, text)`` pairs: GPU, software, what was timed and how, seed, formulas."""
    g = env.get("gpu") or {}
    v = env.get("versions") or {}
    rows = []
    if "error" in g or not g:
        rows.append(("GPU", g.get("error", "none")))
    else:
        clocks = []
        if g.get("sm_clock_mhz"):
            clocks.append(f"SM {g['sm_clock_mhz']} MHz now, {g.get('sm_clock_max_mhz', '?')} max")
        elif g.get("sm_clock_max_mhz"):
            clocks.append(f"SM {g['sm_clock_max_mhz']} MHz max")
        if g.get("mem_clock_max_mhz"):
            clocks.append(f"memory {g['mem_clock_max_mhz']} MHz")
        rows.append(("GPU", f"{g['name']} · {g['sm_count']} SMs · {g['arch']} · "
                            f"{g['memory_bytes'] / 2**30:.0f} GiB · L2 {g['l2_bytes'] / 2**20:.0f} MiB"
                            + (" · " + ", ".join(clocks) if clocks else "")))
    drv = v.get("cuda_driver", "?")
    if v.get("nvidia_driver"):
        drv = f"{drv} (NVIDIA {v['nvidia_driver']})"
    rows.append(("Software", f"flashmla-cupy {v.get('flashmla-cupy')} · CuPy {v.get('cupy')} · "
                             f"NVRTC {v.get('nvrtc')} · CUDA driver {drv} · runtime {v.get('cuda_runtime')} · "
                             f"cuda-bindings {v.get('cuda-bindings')} · CUTLASS {v.get('cutlass')}"))
    if method:
        timed = method["timed"] + (f" · PDL {env.get('pdl', '?')}" if kind != "attention" else "")
        rows.append(("Timed", timed))
        if method.get("baseline"):
            rows.append(("Baseline", method["baseline"]))
        rows.append(("Method", f"{method['timing']}; {method['cache']}; median of up to "
                               f"{method['repeats']} runs (fewer past {method['budget_s_per_target']:g} s "
                               f"per target, at least 10) after {method['warmup_calls']} warm-up calls; "
                               f"spread p10–p90"))
    if seed is not None:
        if kind == "mla":
            rows.append(("Seed", f"{seed} (cache lengths: random.Random({seed}).normalvariate(mean, mean/2), "
                                 f"at least s_q, in grid order, as the seed's test; data: CuPy RNG seeded "
                                 f"{seed} + shape index)"))
        elif kind == "sparse":
            rows.append(("Seed", f"{seed} (data: CuPy RNG seeded {seed} + shape index: q, the cache (standard "
                                 f"normal, then quantized), indices (per query token, distinct tokens of its "
                                 f"request's own s_k), attention sink)"))
        else:
            rows.append(("Seed", f"{seed} (data: CuPy RNG seeded {seed} + shape index, standard normal)"))
    rows.append(("Formulas", FORMULAS[kind]))
    return rows


def print_header(console, rows: list[tuple[str, str]]) -> None:
    from rich.table import Table

    t = Table.grid(padding=(0, 1))
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column()
    for label, text in rows:
        t.add_row(label, text)
    console.print(t)


def _shape_columns(kind: str, records: list[dict]) -> list[tuple[str, callable]]:
    if kind == "mla":
        columns = [
            ("b", lambda r: str(r["batch"])),
            ("s_k", lambda r: f"{r['mean_seqlen']}" + ("~" if r.get("varlen") else "")),
            ("h_q", lambda r: str(r["h_q"])),
            ("s_q", lambda r: str(r["s_q"])),
        ]
        # Only where a row leaves the seed's pages: a default run's table stays as it was.
        if any(r["page_size"] != PAGE_BLOCK for r in records):
            columns.append(("page", lambda r: str(r["page_size"])))
        return columns
    if kind == "sparse":
        return [
            ("b", lambda r: str(r["batch"])),
            ("h_q", lambda r: str(r["h_q"])),
            ("s_q", lambda r: str(r["s_q"])),
            ("s_k", lambda r: str(r["s_k"])),
            ("topk", lambda r: str(r["topk"])),
        ]
    return [
        ("B", lambda r: str(r["batch"])),
        ("H", lambda r: str(r["heads"])),
        ("N", lambda r: str(r["seqlen"])),
        ("d", lambda r: str(r["head_dim"])),
    ]


def group_by_shape(records: list[dict]) -> list[dict[str, dict]]:
    groups: dict[int, dict[str, dict]] = {}
    for r in records:
        groups.setdefault(r["shape_index"], {})[r["name"]] = r
    return [groups[k] for k in sorted(groups)]


def _table(title: str | None):
    from rich import box
    from rich.table import Table

    return Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)


def fmt_spread(rec: dict) -> str:
    """Half the p10–p90 width as a percentage of the median."""
    m, lo, hi = rec.get("ms_median"), rec.get("ms_p10"), rec.get("ms_p90")
    if not (_num(m) and _num(lo) and _num(hi)) or m <= 0:
        return "–"
    return f"±{50 * (hi - lo) / m:.1f}%"


def results_table(records: list[dict], *, kind: str, main: str, others: list[str], check: bool = False,
                  title: str | None = None):
    """One row per shape: the main target's numbers, then each other target's time and speed-up.
    Times in ms; sparse ones in µs, as its FlashMLA anchors are.

    Returns ``(table, error lines)``. ``check`` is accepted for symmetry; the errors against the
    reference have their own table (``check_table``). A target that does not apply to a row shows
    ``n/a`` there (``skipped_lines`` says why).
    """
    unit, fmt_time = ("µs", fmt_us) if kind == "sparse" else ("ms", fmt_ms)
    t = _table(title)
    shape_cols = _shape_columns(kind, records)
    for name, _ in shape_cols:
        t.add_column(name, justify="right", no_wrap=True)
    t.add_column(f"{main}\n{unit}", justify="right", style="bold", no_wrap=True)
    t.add_column("p10–p90\n±", justify="right", style="dim", no_wrap=True)
    t.add_column("TFLOP/s", justify="right", no_wrap=True)
    t.add_column("GB/s", justify="right", no_wrap=True)
    t.add_column("% of\ncopy", justify="right", no_wrap=True)
    t.add_column("% of\nmatmul", justify="right", no_wrap=True)
    t.add_column("bound\n(% of roof)", no_wrap=True)
    clocked = any("sm_clock_mhz" in r for r in records)
    if clocked:
        t.add_column("clock\nMHz", justify="right", no_wrap=True)
    for o in others:
        t.add_column(f"{o}\n{unit}", justify="right", no_wrap=True)
        t.add_column("speed\nup", justify="right", no_wrap=True)
    errors = []
    for group in group_by_shape(records):
        any_rec = next(iter(group.values()))
        m = group.get(main, {})
        cells = [f(any_rec) for _, f in shape_cols]
        where = " ".join(f"{n}={c}" for (n, _), c in zip(shape_cols, cells))
        if m.get("error") or "ms_median" not in m:
            errors.append(f"{main} at {where}: {m.get('error', 'not run')}")
            cells += ["[red]error[/]", "", "", "", "", "", ""] + [""] * clocked
        else:
            cells += [fmt_time(m["ms_median"]), fmt_spread(m), f"{m['tflops']:.0f}", f"{m['gbps']:.0f}",
                      fmt_pct(m.get("frac_copy_bw")), fmt_pct(m.get("frac_matmul")), bound_cell(m)]
            cells += [clock_cell(m)] * clocked
        for o in others:
            r = group.get(o, {})
            if r.get("error"):
                errors.append(f"{o} at {where}: {r['error']}")
                cells += ["[red]error[/]", ""]
            elif r.get("skipped"):
                cells += ["[dim]n/a[/]", "–"]
            else:
                sp = m.get("speedup") if m.get("speedup_vs") == o else None
                cells += [fmt_time(r.get("ms_median")), f"{sp:.1f}×" if _num(sp) else "–"]
        t.add_row(*cells)
    return t, errors


def skipped_lines(records: list[dict]) -> list[str]:
    """Per target and reason, the rows it did not apply to: ``flash_mla at 2 of 4 shapes: why``."""
    shapes = len({r["shape_index"] for r in records})
    counts: dict[tuple[str, str], int] = {}
    for r in records:
        if r.get("skipped"):
            counts[r["name"], r["skipped"]] = counts.get((r["name"], r["skipped"]), 0) + 1
    return [f"{name} at {n} of {shapes} shapes: {why}" for (name, why), n in counts.items()]


def check_table(records: list[dict], *, kind: str, targets: list[str], title: str | None = None):
    """--check: per shape and target, cos_diff and max |error| against the float64 reference."""
    from .runner import ATTENTION_MAX_ABS_LIMIT, COS_DIFF_LIMIT

    with_lse = kind in OUT_AND_LSE_KINDS
    limit = (f"pass: cos_diff < {COS_DIFF_LIMIT:g} for out and lse; an e4m3 q, with P in e4m3: out < 2^-8" if with_lse
             else f"pass: max |error| < {ATTENTION_MAX_ABS_LIMIT:g}")
    t = _table(title or f"error against the float64 reference ({limit})")
    shape_cols = _shape_columns(kind, records)
    for name, _ in shape_cols:
        t.add_column(name, justify="right", no_wrap=True)
    for name in targets:
        t.add_column(f"{name}\ncos_diff", justify="right", no_wrap=True)
        t.add_column("max |Δ|", justify="right", no_wrap=True)
        if with_lse:
            t.add_column("lse\ncos_diff", justify="right", no_wrap=True)
            t.add_column("lse\nmax |Δ|", justify="right", no_wrap=True)
    for group in group_by_shape(records):
        any_rec = next(iter(group.values()))
        cells = [f(any_rec) for _, f in shape_cols]
        for name in targets:
            r = group.get(name, {})
            ok = r.get("check_ok")
            style = "" if ok is None else ("green" if ok else "red")
            vals = [r.get("cos_diff_out"), r.get("max_abs_out")]
            if with_lse:
                vals += [r.get("cos_diff_lse"), r.get("max_abs_lse")]
            cells += [f"[{style}]{fmt_sci(v)}[/]" if style else fmt_sci(v) for v in vals]
        t.add_row(*cells)
    return t


# --------------------------------------------------------------------------------------------
# Exports
# --------------------------------------------------------------------------------------------

def _csv_value(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.6g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


def _with_ceilings(records: list[dict], c: Ceilings) -> list[dict]:
    return [{**r, "copy_gbps_ceiling": c.copy_gbps, "matmul_tflops_ceiling": c.matmul_tflops} for r in records]


def write_csv(path, records: list[dict], ceilings: Ceilings) -> Path:
    path = Path(path)
    rows = _with_ceilings(records, ceilings)
    extra = sorted({k for r in rows for k in r} - set(CSV_COLUMNS) - {"shape_index"})
    present = {k for r in rows for k in r}
    columns = SEED_COLUMNS + [c for c in CSV_COLUMNS[len(SEED_COLUMNS):] if c in present] + extra
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_csv_value(r.get(c)) for c in columns])
    return path


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _json_default(x):
    """NumPy scalars and paths, which ``json`` does not know."""
    if hasattr(x, "item"):
        v = x.item()
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return str(x)


def json_payload(*, kind: str, records: list[dict], ceilings: Ceilings, method: dict | None,
                 environment: dict, config: dict, interrupted: bool = False) -> dict:
    return _json_safe({
        "tool": "flashmla-cupy profile",
        "schema": 1,
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "interrupted": interrupted,
        "environment": environment,
        "ceilings": ceilings.as_dict(),
        "method": method,
        "config": config,
        "records": records,
    })


def write_json(path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, allow_nan=False, default=_json_default) + "\n")
    return path


def matplotlib_status() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return PLOT_MISSING
    return None


def plot(path, records: list[dict], ceilings: Ceilings, *, kind: str, title: str = "") -> Path:
    """PNG: GB/s and TFLOP/s against the mean cache length (MLA) or N (attention), per target.

    MLA: one column of axes per s_q (and page size, where a row is not at 64), colour per h_q, solid /
    dashed for fixed / varlen lengths, a marker per target; the measured ceilings as horizontal lines.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "gbps" in r]
    targets = list(dict.fromkeys(r["name"] for r in ok))
    markers = dict(zip(targets, "osD^v<>"))
    paged = kind == "mla" and any(r["page_size"] != PAGE_BLOCK for r in ok)
    if kind == "mla":
        panels = sorted({(r["s_q"], r["page_size"]) for r in ok}) or [(1, PAGE_BLOCK)]
        colour_key, colour_label = "h_q", "h_q"
    else:
        panels = [None]
        colour_key, colour_label = "head_dim", "d"
    fig, axes = plt.subplots(2, len(panels), figsize=(6 * len(panels), 8), squeeze=False)
    cmap = plt.get_cmap("viridis")
    colour_values = sorted({r.get(colour_key) for r in ok})
    colours = {v: cmap(i / max(len(colour_values) - 1, 1)) for i, v in enumerate(colour_values)}
    x_key = "mean_seqlen" if kind == "mla" else "seqlen"
    for col, panel in enumerate(panels):
        sub = [r for r in ok if panel is None or (r["s_q"], r["page_size"]) == panel]
        series: dict[tuple, list[dict]] = {}
        for r in sub:
            series.setdefault((r["name"], r.get(colour_key), bool(r.get("varlen"))), []).append(r)
        for (name, cv, varlen), rs in sorted(series.items(), key=lambda kv: (targets.index(kv[0][0]),
                                                                              str(kv[0][1]).zfill(8), kv[0][2])):
            rs = sorted(rs, key=lambda r: r[x_key])
            xs = [r[x_key] for r in rs]
            style = dict(color=colours.get(cv), marker=markers.get(name, "o"),
                         linestyle="--" if varlen else "-")
            axes[0][col].plot(xs, [r["gbps"] for r in rs], **style)
            axes[1][col].plot(xs, [r["tflops"] for r in rs], **style)
        if ceilings.copy_gbps:
            axes[0][col].axhline(ceilings.copy_gbps, color="grey", linestyle=":")
        if ceilings.matmul_tflops:
            axes[1][col].axhline(ceilings.matmul_tflops, color="grey", linestyle=":")
        suffix = ""
        if panel is not None:
            s_q, page = panel
            suffix = f" (s_q = {s_q}" + (f", page {page}" if paged else "") + ")"
        axes[0][col].set_title(f"bandwidth{suffix}")
        axes[1][col].set_title(f"throughput{suffix}")
        axes[0][col].set_ylabel("GB/s")
        axes[1][col].set_ylabel("TFLOP/s")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("mean cache length (tokens)" if kind == "mla" else "N (sequence length)")
            ax.grid(True, alpha=0.3)
    # One compact legend: colour = heads (or d), marker = target, line = fixed / varlen lengths.
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=colours[v], label=f"{colour_label}={v}") for v in colour_values]
    handles += [Line2D([], [], color="black", marker=markers[t], linestyle="none", label=t) for t in targets]
    if kind == "mla":
        handles += [Line2D([], [], color="black", linestyle="-", label="fixed lengths"),
                    Line2D([], [], color="black", linestyle="--", label="varlen")]
    handles.append(Line2D([], [], color="grey", linestyle=":", label="measured ceiling"))
    fig.legend(handles=handles, loc="center right", fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
