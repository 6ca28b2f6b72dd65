"""The ``flashmla-cupy`` command line (also ``python -m flashmla_cupy``).

    flashmla-cupy [profile] [mla]      the seed's MLA grid against the measured roofs (default)
    flashmla-cupy profile sparse       DeepSeek-V3.2 sparse FP8 decoding, the production grid
    flashmla-cupy profile attention    flash_attn_minimal vs manual attention (seed 000), N sweep
    flashmla-cupy compile              build or verify every kernel's cubin; ptxas report
    flashmla-cupy info                 device, driver, versions, bundled cubins, compile cache

This module only parses arguments and wires the pieces in ``flashmla_cupy.profiler`` together.
Progress goes to stderr, results to stdout; where a stream is not a terminal (a pipe, a log),
progress comes as plain lines, without bars.
"""
from __future__ import annotations

import argparse
import re
import sys

from .profiler.shapes import FP8_CACHE, FP8_Q, q_dtypes

SUBCOMMANDS = ("profile", "compile", "info")
PROFILE_KINDS = ("mla", "sparse", "attention")     # `flashmla-cupy KIND` = `flashmla-cupy profile KIND`
EPILOG = """\
examples:
  flashmla-cupy                              full seed grid (b 128; s_k 4096/8192/16384; h_q 16-128; s_q 1, 2; varlen off/on)
  flashmla-cupy profile --quick --check      four shapes, with the error against a float64 reference
  flashmla-cupy profile --heads 128 --s-q 1 --varlen off --baseline cupy --csv out.csv --plot out.png
  flashmla-cupy profile --quick --inputs torch --baseline flash_mla    torch tensors, FlashMLA side by side
  flashmla-cupy profile --quick --value-checks off                   the default call without value checks
  flashmla-cupy profile --quick --page-size 1,16,64,256 --check      each shape at four KV-cache page sizes
  flashmla-cupy profile --quick --dtype fp8 --check                  the dense FP8 cache (576 B/token), bf16 q
  flashmla-cupy profile --quick --dtype fp8 --q-dtype fp8 --check    the same cache read by an e4m3 q
  flashmla-cupy profile sparse --quick --check   DeepSeek-V3.2 sparse FP8 decoding, two production rows
  flashmla-cupy profile attention            the minimal FlashAttention kernel against manual attention
  flashmla-cupy compile --arch sm_90a        build every kernel without a GPU
"""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _page_sizes(text: str) -> list[int]:
    from .profiler.shapes import is_page_size

    try:
        values = _int_list(text)
    except argparse.ArgumentTypeError:        # not integers, or not positive: the same answer
        values = []
    if not values or not all(is_page_size(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected powers of two (1, 2, 4, ..., 64, 128, 256, ...), got {text!r}")
    return values


def _positive_int(text: str) -> int:
    v = _int_list(text)
    if len(v) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return v[0]


def _arch(text: str) -> str:
    if not re.fullmatch(r"sm_\d{2,3}[af]?", text):
        raise argparse.ArgumentTypeError(f"expected an SM target such as sm_90a, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    from .profiler.env import package_version
    from .profiler.timing import FLUSH_MODES

    p = argparse.ArgumentParser(
        prog="flashmla-cupy",
        description="FlashMLA decoding attention on CuPy: profiler, ahead-of-time compiler, environment report.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"flashmla-cupy {package_version()}")
    sub = p.add_subparsers(dest="command", metavar="{profile,compile,info}")

    # ---- profile -------------------------------------------------------------------------
    pr = sub.add_parser(
        "profile", help="time the kernels against the measured hardware ceilings (default)",
        description="Time each shape (CUDA events, L2 flushed, warm-up first) and compare with the copy-"
                    "bandwidth and matmul ceilings measured in the same run. MLA: what is timed is the call "
                    "users make (default arguments, value checks in their current mode) on CuPy arrays, or on "
                    "torch tensors with --inputs torch; --baseline flash_mla times FlashMLA's own call beside it; "
                    "--dtype fp8 times it over the dense FP8 cache (--q-dtype fp8: with an e4m3 q). "
                    "Sparse: the same call with indices over the FP8 cache; --baseline flash_mla times FlashMLA's "
                    "own sparse call beside it, else on an H200 FlashMLA's times from another run stand beside it.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    pr.add_argument("what", nargs="?", choices=PROFILE_KINDS, default="mla",
                    help="mla: paged MLA decoding, the seed's grid (default); sparse: DeepSeek-V3.2 sparse "
                         "decoding over the FP8 cache, its production grid; "
                         "attention: flash_attn_minimal vs manual attention (seed 000)")
    g = pr.add_argument_group("shapes (sparse: each option given replaces that column of every production row)")
    g.add_argument("--quick", action="store_true",
                   help="a few shapes (seconds, not minutes): 4 of the MLA grid, the first 2 sparse rows, "
                        "or N 64 and 1024 for attention")
    g.add_argument("--dtype", choices=("bf16", "fp16", FP8_CACHE), default="bf16",
                   help="MLA: q and KV-cache dtype (default bf16); fp8 = the dense FP8 cache (e4m3 codes, one "
                        "float32 k_scale, 576 B/token) with bf16 out and bf16 q (or e4m3: --q-dtype): h_kv 1, the "
                        "baselines n/a (FlashMLA has no dense FP8 decoding on Hopper). Not for sparse")
    g.add_argument("--q-dtype", dest="q_dtype", choices=("bf16", "fp16", FP8_Q),
                   help="MLA: q's dtype, the cache's by default; only --dtype fp8 takes another: fp8 = e4m3 codes "
                        "with one float32 q_scale (1 B/element; out stays bf16). Sparse: bf16 only")
    g.add_argument("--batch", type=_int_list, metavar="B[,B...]",
                   help="batch sizes (default: 128; attention: 16)")
    g.add_argument("--seqlens", type=_int_list, metavar="S[,S...]",
                   help="mean cache lengths (default 4096,8192,16384); sparse: s_k, the tokens each request "
                        "owns; attention: N (default 64,...,4096)")
    g.add_argument("--heads", type=_int_list, metavar="H[,H...]",
                   help="query heads (default 16,32,64,128; attention: 12)")
    g.add_argument("--s-q", dest="s_q", type=_int_list, metavar="S[,S...]",
                   help="query tokens per request (default 1,2)")
    g.add_argument("--topk", type=_int_list, metavar="K[,K...]",
                   help="sparse: cache tokens each query token attends to (production rows: 2048, 16384)")
    g.add_argument("--h-kv", dest="h_kv", type=_positive_int, default=1, help="KV heads (default 1)")
    g.add_argument("--page-size", dest="page_sizes", type=_page_sizes, metavar="P[,P...]",
                   help="MLA: tokens per KV-cache page, powers of two (default 64, the seed's); every shape runs "
                        "at each size given, with the same cache lengths. --baseline flash_mla is n/a at sizes "
                        "other than 64 (FlashMLA takes 64 only). Not for sparse")
    g.add_argument("--head-dim", dest="head_dim", type=_positive_int, default=64,
                   help="attention head dim (default 64)")
    g.add_argument("--varlen", choices=("on", "off", "both"), default="both",
                   help="cache lengths drawn from normal(mean, mean/2) (on), all equal (off), or both (default)")
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="causal mask (default: on for MLA as in the seed, off for attention)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the cache-length draws and the data (default 0, the seed test's)")
    t = pr.add_argument_group("timing")
    t.add_argument("--repeats", type=_positive_int, default=100, help="timed runs per target (default 100)")
    t.add_argument("--warmup", type=_positive_int, default=10, help="warm-up calls per target (default 10)")
    t.add_argument("--budget", type=float, default=3.0, metavar="SECONDS",
                   help="fewer runs (at least 10) when a target would take longer than this (default 3)")
    t.add_argument("--graph", action="store_true",
                   help="time replays of a CUDA graph captured from one call (no Python launch overhead)")
    t.add_argument("--flush", choices=FLUSH_MODES, default="write",
                   help="how the L2 is emptied before each run: write (a memset, as triton's do_bench "
                        "that FlashMLA's own figures use; its dirty lines are written back during the "
                        "timed run), read (clean lines: no write-back), none (warm cache); default write")
    t.add_argument("--no-ceilings", dest="ceilings", action="store_false",
                   help="skip measuring the copy and matmul ceilings")
    t.add_argument("--device", type=int, default=0, help="CUDA device (default 0)")
    o = pr.add_argument_group("comparison and output")
    o.add_argument("--baseline", choices=("flash_mla", "cupy", "none"), default="none",
                   help="MLA: also time another implementation on the same buffers in the same process, "
                        "with a speed-up column (its time / ours): flash_mla = FlashMLA's own "
                        "flash_mla_with_kvcache (the flash_mla package, seed or upstream API; skipped with the "
                        "reason when it is not importable, n/a at page sizes other than 64 and with --dtype fp8), "
                        "cupy = the plain CuPy implementation (flashmla_cupy.baselines; n/a with --dtype fp8); "
                        "default none. Sparse: flash_mla only (FlashMLA's upstream API, h_q 64 and 128); without it, "
                        "on an H200, FlashMLA's times from another run stand beside ours. attention always "
                        "compares with manual attention")
    o.add_argument("--inputs", choices=("cupy", "torch"), default="cupy",
                   help="MLA: what the timed call gets: cupy = CuPy arrays, flashmla_cupy.flash_mla_with_kvcache "
                        "(default); torch = torch tensors viewing the same buffers (DLPack), through the drop-in "
                        "flashmla_cupy.flash_mla, on torch's current stream (needs torch with CUDA)")
    o.add_argument("--value-checks", dest="value_checks", choices=("async", "sync", "off"), default=None,
                   help="MLA, sparse: value check mode of the timed calls (see the README's Value checks): async "
                        "(records bad values, raises at the next call), sync (synchronizes after each call), "
                        "off; default: the library's current mode (async unless FLASHMLA_CUPY_VALUE_CHECKS "
                        "says otherwise). The mode is in the header and the JSON")
    o.add_argument("--check", action="store_true",
                   help="error against the float64 reference (cos_diff, max |error|) for every target")
    o.add_argument("--csv", metavar="PATH", help="write every number (seed columns name,batch,seqlen,head,bw first)")
    o.add_argument("--json", metavar="PATH", help="write every number with the environment and ceilings")
    o.add_argument("--plot", metavar="PATH",
                   help="write a PNG of GB/s and TFLOP/s per target (needs matplotlib; mla and attention)")
    pr.set_defaults(func=cmd_profile)

    # ---- compile -------------------------------------------------------------------------
    co = sub.add_parser("compile", help="build (or verify cached) cubins for every kernel; ptxas report",
                        description="Compile every kernel program with NVRTC into the cubin cache (no GPU "
                                    "needed), showing registers, stack and spills per kernel.")
    co.add_argument("--arch", type=_arch, help="target, e.g. sm_90a (default: the GPU's, or sm_90a without a GPU)")
    co.add_argument("--jobs", type=_positive_int, help="parallel compiler processes (default: one per program, "
                                                     "at most the CPU count)")
    co.add_argument("--only", action="append", metavar="NAME",
                    help="only programs whose name contains NAME (repeatable), e.g. --only combine")
    co.add_argument("--list", action="store_true", help="list the programs and exit without building")
    co.add_argument("--json", metavar="PATH", help="write the per-kernel report as JSON")
    co.set_defaults(func=cmd_compile)

    # ---- info ----------------------------------------------------------------------------
    inf = sub.add_parser("info", help="device, versions, compile cache",
                         description="Report the device (or its absence), the versions of everything "
                                     "involved and the compile cache.")
    inf.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inf.set_defaults(func=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS + PROFILE_KINDS:
        parser.error(_unknown_command(argv[0]))
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help", "--version")):
        argv = ["profile", *argv]           # no command (or only options, or mla/attention): profile
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _unknown_command(word: str) -> str:
    import difflib

    close = difflib.get_close_matches(word, SUBCOMMANDS + PROFILE_KINDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (f"unknown command {word!r}{hint} (commands: {', '.join(SUBCOMMANDS)}; "
            f"without one, flashmla-cupy runs profile)")


# --------------------------------------------------------------------------------------------
# profile
# --------------------------------------------------------------------------------------------

def console(stderr: bool = False):
    """A rich console bound to stdout or stderr; when the stream is not a terminal (logs, pipes)
    and COLUMNS is unset, 160 columns wide instead of rich's 80, so that the tables keep their
    shape in captured output."""
    import os

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    width = None if tty or os.environ.get("COLUMNS") else 160
    return Console(file=stream, width=width)


def _fail(command: str, message: str) -> SystemExit:
    return SystemExit(f"flashmla-cupy {command}: {message}")


def _mla_shapes(args):
    from .profiler import shapes as shp

    causal = True if args.causal is None else args.causal
    page_sizes = args.page_sizes or (shp.PAGE_BLOCK,)
    if args.quick:
        return shp.quick_grid(page_sizes=page_sizes, h_kv=args.h_kv, causal=causal, dtype=args.dtype,
                              q_dtype=args.q_dtype, seed=args.seed)
    varlens = {"on": (True,), "off": (False,), "both": (False, True)}[args.varlen]
    return shp.mla_grid(args.batch or shp.SEED_BATCHES, args.seqlens or shp.SEED_SEQLENS,
                        args.heads or shp.SEED_HEADS, args.s_q or shp.SEED_S_Q, varlens, page_sizes=page_sizes,
                        h_kv=args.h_kv, causal=causal, dtype=args.dtype, q_dtype=args.q_dtype, seed=args.seed)


def _sparse_shapes(args):
    from .profiler import shapes as shp

    return shp.sparse_grid(args.batch or (), args.heads or (), args.s_q or (), args.seqlens or (), args.topk or (),
                           quick=args.quick)


def _attention_shapes(args):
    from .profiler import shapes as shp

    b, h, _, d = shp.ATTENTION_SEED_SHAPE
    ns = (64, 1024) if args.quick else (args.seqlens or shp.ATTENTION_SWEEP_N)
    shapes = []
    for batch in (args.batch or [b]):
        for heads in (args.heads or [h]):
            shapes += shp.attention_grid(batch, heads, args.head_dim, ns, causal=bool(args.causal))
    return shapes


def select_targets(kind: str, inputs: str, baseline: str) -> tuple[str, str | None]:
    """``(main target, baseline target or None)`` for ``profile``'s options."""
    from .profiler import targets

    if kind == "mla":
        return targets.MAIN_MLA_TARGETS[inputs], (None if baseline == "none" else baseline)
    if kind == "sparse":
        return targets.MAIN_SPARSE_TARGET, (None if baseline == "none" else baseline)
    return targets.MAIN_ATTENTION_TARGET, targets.ATTENTION_BASELINE


def _mla_refusal(args) -> str | None:
    """Why ``profile`` (MLA) cannot do what these options ask, or ``None``."""
    if args.dtype == FP8_CACHE and args.h_kv != 1:
        return (f"--dtype fp8 takes --h-kv 1 only: the FP8 cache kernel reads one latent KV head; "
                f"got --h-kv {args.h_kv}")
    allowed = q_dtypes(args.dtype)
    if args.q_dtype not in (None, *allowed):
        return (f"--q-dtype {args.q_dtype} is not available with --dtype {args.dtype}, whose q is "
                f"{' or '.join(allowed)}: q's dtype is a 16-bit cache's own, and an e4m3 q (fp8) reads the dense "
                "FP8 cache only")
    return None


def _sparse_refusal(args) -> str | None:
    """Why ``profile sparse`` cannot do what these options ask, or ``None``."""
    if args.dtype == FP8_CACHE:
        return ("--dtype fp8 is not available for sparse: sparse decoding always reads DeepSeek-V3.2's own FP8 "
                "cache (656 B/token, a scale per 128 values); --dtype fp8 is the dense FP8 cache of profile mla")
    if args.q_dtype not in (None, "bf16"):
        return (f"--q-dtype {args.q_dtype} is not available for sparse: sparse decoding reads bf16 q "
                "(an e4m3 q, fp8, reads the dense FP8 cache of profile mla)")
    if args.baseline == "cupy":
        return ("--baseline cupy is not available for sparse: there is no plain CuPy sparse decoding "
                "(--baseline flash_mla times FlashMLA's own sparse call)")
    if args.inputs != "cupy":
        return f"--inputs {args.inputs} is not available for sparse: it times CuPy arrays"
    if args.plot:
        return "--plot is not available for sparse: its rows are production shapes, not a sweep to draw"
    if args.page_sizes:
        return ("--page-size is not available for sparse: the call reads the tokens its indices name "
                "(block · page size + offset), so the page size only reshapes the same cache")
    return None


def cmd_profile(args) -> int:
    from .profiler import build, report, runner, targets
    from .profiler.env import NoGPU, environment

    kind = args.what
    why = _mla_refusal(args) if kind == "mla" else _sparse_refusal(args) if kind == "sparse" else None
    if why:
        raise _fail("profile", why)
    if args.plot and report.matplotlib_status():
        raise _fail("profile", report.matplotlib_status())
    try:
        shape_list = {"mla": _mla_shapes, "sparse": _sparse_shapes, "attention": _attention_shapes}[kind](args)
    except ValueError as e:
        raise _fail("profile", str(e)) from None
    from . import value_check_mode

    main_t, baseline = select_targets(kind, args.inputs, args.baseline)
    names = [main_t] + ([baseline] if baseline else [])
    on_mla_kernels = kind != "attention"      # dense or sparse: Hopper only, bf16 roof, value checks
    config = runner.RunConfig(targets=names, baseline=baseline, repeats=args.repeats, warmup=args.warmup,
                              budget_s=args.budget, graph=args.graph, flush=args.flush, check=args.check,
                              seed=args.seed, device=args.device, measure_ceilings=args.ceilings,
                              matmul_dtype="bf16" if on_mla_kernels else "fp32", inputs=args.inputs,
                              value_checks=(args.value_checks or value_check_mode()) if on_mla_kernels else None)
    try:
        gpu = runner.require_device(config, need_hopper=on_mla_kernels)
    except NoGPU as e:
        raise _fail("profile", f"{e}. `flashmla-cupy info` shows the environment; "
                               "`flashmla-cupy compile --arch sm_90a` builds the kernels without a GPU.") from None
    if on_mla_kernels:
        why = targets.TARGETS[kind][main_t].requires()
        if why:
            raise _fail("profile", f"--inputs {args.inputs} cannot run here: {why}")

    out = console()
    err = console(stderr=True)
    env = environment(args.device)
    report.print_header(out, report.header_lines(env, runner.method_description(
        config, gpu.get("l2_bytes", 0), kind), kind=kind, seed=args.seed))
    try:
        heads = tuple(s.h_q for s in shape_list) if kind == "sparse" else ()
        build.prebuild(build.profile_programs(kind, args.dtype, args.q_dtype, tuple(args.page_sizes or ()), heads),
                       err, arch=gpu["arch"])
    except Exception as e:  # noqa: BLE001 - the run reports per-target failures itself
        err.print(f"[yellow]kernel prebuild failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}[/]")

    result = _run_with_progress(runner.workload(kind, args.dtype), shape_list, config, gpu, err)

    out.print()
    for line in report.describe_ceilings(result.ceilings):
        out.print(f"[bold cyan]Ceiling[/] {line}", highlight=False)
    if result.method and result.method.get("clocks"):
        out.print(f"[bold cyan]Clocks[/] {result.method['clocks']}", highlight=False)
    # Every target with a record: the measured ones not skipped, and anchors from another run.
    others = list(dict.fromkeys(r["name"] for r in result.records if r["name"] != main_t))
    table, errors = report.results_table(result.records, kind=kind, main=main_t, others=others,
                                         title=_table_title(kind, shape_list[0]))
    out.print(table)
    if args.check:
        measured = [n for n in [main_t, *others] if n in names]        # anchors have no outputs to check
        out.print(report.check_table(result.records, kind=kind, targets=measured))
    for e in errors:
        out.print(f"[red]error[/] {e}", highlight=False)
    for n in [main_t, *others]:           # a note shared by all of a target's rows, e.g. FlashMLA's API
        notes = {r.get("notes") for r in result.records if r["name"] == n and "ms_median" in r}
        if len(notes) == 1 and None not in notes:
            out.print(f"[cyan]note[/] {n}: {notes.pop()}", highlight=False)
    for n, why in result.skipped_targets.items():
        out.print(f"[yellow]skipped[/] {n}: {why}", highlight=False)
    for line in report.skipped_lines(result.records):
        out.print(f"[yellow]skipped[/] {line}", highlight=False)
    if result.interrupted:
        out.print("[yellow]interrupted: the table holds the shapes measured so far[/]")
    _export(args, kind, result, env, config, out)

    main_rows = [r for r in result.records if r["name"] == main_t]
    failed = any(r.get("error") for r in main_rows) or any(r.get("check_ok") is False for r in main_rows)
    return 1 if (failed or result.interrupted or main_t in result.skipped_targets) else 0


def _table_title(kind: str, shape) -> str:
    if kind == "mla":
        q = "e4m3" if shape.q_dtype == FP8_Q else shape.q_dtype
        dtype = f"q {q}, FP8 cache (576 B/token, one scale)" if shape.dtype == FP8_CACHE else shape.dtype
        return f"MLA decoding, {dtype}, {'causal' if shape.causal else 'non-causal'}, h_kv {shape.h_kv}"
    if kind == "sparse":
        return "DeepSeek-V3.2 sparse decoding: q bf16, FP8 cache (656 B/token), attention sink"
    return "attention, float32"


def _run_with_progress(work, shape_list, config, gpu, err):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    from .profiler import runner

    total = len(shape_list) * len(config.targets)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as progress:
        task = progress.add_task("starting", total=total)

        def on_record(rec):
            progress.advance(task)
            if rec.get("ms_median") is not None:
                progress.console.print(
                    f"  {rec['name']:<18} {_shape_text(work.kind, rec):<36} {rec['ms_median']:.3f} ms  "
                    f"{rec['gbps']:.0f} GB/s  {rec['tflops']:.0f} TFLOP/s", highlight=False)

        return runner.run(work, shape_list, config, gpu=gpu,
                          on_progress=lambda msg: progress.update(task, description=msg),
                          on_record=on_record,
                          on_note=lambda msg: progress.console.print(f"[yellow]{msg}[/]", highlight=False))


def _shape_text(kind: str, r: dict) -> str:
    if kind == "mla":
        from .profiler.shapes import page_text
        return (f"b={r['batch']} s_k={r['mean_seqlen']}{'~' if r.get('varlen') else ''} "
                f"h_q={r['h_q']} s_q={r['s_q']}{page_text(r['page_size'])}")
    if kind == "sparse":
        return f"b={r['batch']} h_q={r['h_q']} s_q={r['s_q']} s_k={r['s_k']} topk={r['topk']}"
    return f"B={r['batch']} H={r['heads']} N={r['seqlen']} d={r['head_dim']}"


def _export(args, kind, result, env, config, out) -> None:
    from .profiler import report

    if args.csv:
        path = report.write_csv(args.csv, result.records, result.ceilings)
        out.print(f"wrote {path}")
    if args.json:
        payload = report.json_payload(kind=kind, records=result.records, ceilings=result.ceilings,
                                      method=result.method, environment=env,
                                      config={**config.as_dict(), "seed_grid_seed": args.seed},
                                      interrupted=result.interrupted)
        path = report.write_json(args.json, payload)
        out.print(f"wrote {path}")
    if args.plot:
        title = f"flashmla-cupy {kind} on {env.get('gpu', {}).get('name', '?')}"
        path = report.plot(args.plot, result.records, result.ceilings, kind=kind, title=title)
        out.print(f"wrote {path}")


# --------------------------------------------------------------------------------------------
# compile
# --------------------------------------------------------------------------------------------

def cmd_compile(args) -> int:
    from rich.table import Table

    from . import bundled, compiler
    from .profiler import build

    out = console()
    err = console(stderr=True)
    if args.arch:
        arch, source = args.arch, "--arch"
        why = _unsupported_arch(arch)
        if why:
            raise _fail("compile", why)
    else:
        arch, source = build.default_arch()
    programs = build.filter_programs(build.collect_programs(), args.only)
    if args.list:
        t = Table(title=f"kernel programs ({arch}, {source})", header_style="bold")
        for c in ("program", "source", "kernels", "cached"):
            t.add_column(c)
        for p in programs:
            cached = ("bundled" if bundled.lookup(p, arch) else
                      "yes" if compiler.entry_path(p, arch).is_file() else "no")
            t.add_row(p.name, p.source, "\n".join(p.kernels), cached)
        out.print(t)
        return 0
    if not programs:
        raise _fail("compile", "no kernel programs to build" + (f" matching {args.only}" if args.only else ""))
    out.print(f"building {len(programs)} program(s) for [bold]{arch}[/] ({source}); cache: {compiler.cache_dir()}",
              highlight=False)
    try:
        cubins, wall = build.build_with_progress(programs, arch, args.jobs, err)
    except compiler.CompileError as e:
        lines = str(e).splitlines()
        err.print("\n".join(lines[:60]) + ("\n..." if len(lines) > 60 else ""), highlight=False, markup=False)
        raise _fail("compile", lines[0] if lines else "NVRTC failed") from None
    out.print(build.resources_table(cubins, arch))
    shipped = sum(c.bundled for c in cubins)
    hits = sum(c.from_cache for c in cubins) - shipped
    out.print(f"{len(cubins)} program(s): {shipped} bundled, {hits} cache hit(s), "
              f"{len(cubins) - hits - shipped} compiled; {wall:.1f} s wall", highlight=False)
    if args.json:
        import json
        from pathlib import Path
        Path(args.json).write_text(json.dumps({"arch": arch, "cache_dir": str(compiler.cache_dir()),
                                               "kernels": build.records(cubins)}, indent=2) + "\n")
        out.print(f"wrote {args.json}")
    return 0


def _unsupported_arch(arch: str) -> str | None:
    """Why NVRTC cannot build for ``arch`` (its list of targets), or ``None`` (also where NVRTC
    cannot be asked: the compile then says what is wrong)."""
    from . import compiler
    try:
        nvrtc = compiler._nvrtc()
        supported = nvrtc.getSupportedArchs()
        version = "%d.%d" % nvrtc.getVersion()
    except Exception:  # noqa: BLE001 - NVRTC missing or too old to say
        return None
    number = int(re.match(r"sm_(\d+)", arch).group(1))
    if number in supported:
        return None
    return f"--arch {arch}: NVRTC {version} builds for {', '.join(f'sm_{n}' for n in supported)}"


# --------------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------------

def info_data() -> dict:
    from . import bundled, compiler
    from .profiler.env import NoGPU, bf16_status, device_info, gpu_count, pdl_state, versions

    data: dict = {"versions": versions()}
    try:
        n = gpu_count()
        data["gpus"] = [device_info(i) for i in range(n)]
    except NoGPU as e:
        data["gpus"] = []
        data["no_gpu"] = str(e)
    why = bf16_status()
    data["bfloat16"] = "available (ml_dtypes.bfloat16)" if why is None else f"unavailable: {why}"
    data["pdl"] = pdl_state()
    data["bundled"] = {"dir": str(bundled.directory()), "entries": _entry_records(bundled.entries())}
    try:
        entries = _entry_records(compiler.cache_entries())
        cache = str(compiler.cache_dir())
    except Exception as e:  # noqa: BLE001
        entries, cache = [], f"unavailable ({type(e).__name__}: {e})"
    data["cache"] = {"dir": cache, "entries": entries, "total_bytes": sum(e["size"] for e in entries)}
    return data


def _entry_records(entries) -> list[dict]:
    out = []
    for path, header, size in entries:
        h = header or {}
        out.append({"file": path.name, "size": size, "program": h.get("program"), "arch": h.get("arch"),
                    "created": h.get("created"), "compile_seconds": h.get("compile_seconds"),
                    "nvrtc": h.get("toolchain", {}).get("nvrtc"), "valid": header is not None})
    return out


def info_rows(data: dict) -> list[tuple[str, str]]:
    """``info``'s report as (label, value) rows."""
    rows = []
    for g in data["gpus"]:
        clocks = f" · SM {g['sm_clock_max_mhz']} MHz max" if g.get("sm_clock_max_mhz") else ""
        rows.append((f"GPU {g['id']}", f"{g['name']} · {g['arch']} · {g['sm_count']} SMs · "
                                       f"{g['memory_bytes'] / 2**30:.0f} GiB · L2 {g['l2_bytes'] / 2**20:.0f} MiB{clocks}"))
    if not data["gpus"]:
        rows.append(("GPU", f"no GPU — {data.get('no_gpu', '')}"))
    labels = {"flashmla-cupy": "flashmla-cupy", "python": "Python", "cupy": "CuPy", "nvrtc": "NVRTC",
              "cuda_driver": "CUDA driver API", "nvidia_driver": "NVIDIA driver", "cuda_runtime": "CUDA runtime",
              "cuda-bindings": "cuda-bindings", "cutlass": "CUTLASS headers", "cutlass_include": "CUTLASS include",
              "numpy": "NumPy", "ml_dtypes": "ml_dtypes", "rich": "rich", "matplotlib": "matplotlib (plots)",
              "cublas": "cuBLAS (ceilings, baseline)", "platform": "platform"}
    for key, label in labels.items():
        v = data["versions"].get(key)
        if v is None:
            v = "unknown (reported through nvidia-ml-py)" if key == "nvidia_driver" else "not installed"
        rows.append((label, str(v)))
    rows.append(("bfloat16", data["bfloat16"]))
    rows.append(("PDL", data["pdl"]))
    b = data["bundled"]["entries"]
    if b:
        built = sorted({f"NVRTC {e['nvrtc']}" for e in b if e["nvrtc"]})
        archs = sorted({str(e["arch"]) for e in b})
        rows.append(("bundled cubins", f"{len(b)} for {', '.join(archs)} ({', '.join(built) or 'NVRTC ?'}; "
                                       f"used without compiling) in {data['bundled']['dir']}"))
    else:
        rows.append(("bundled cubins", "none (installed from source: kernels compile with NVRTC on first use)"))
    c = data["cache"]
    rows.append(("compile cache", f"{c['dir']} — {len(c['entries'])} entr{'y' if len(c['entries']) == 1 else 'ies'}, "
                                  f"{c['total_bytes'] / 2**20:.1f} MiB"))
    return rows


def cmd_info(args) -> int:
    from rich.markup import escape
    from rich.table import Table

    data = info_data()
    out = console()
    if args.json:
        import json
        out.print_json(json.dumps(data, default=str))
        return 0
    rows = info_rows(data)
    if out.is_terminal:
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold cyan", no_wrap=True)
        t.add_column(overflow="fold")
        for label, value in rows:
            t.add_row(label, escape(value))
        out.print(t)
    else:                       # plain lines in pipes and logs: no wrapping, no padding
        width = max(len(label) for label, _ in rows)
        for label, value in rows:
            out.print(f"{label:<{width}}  {value}", markup=False, highlight=False, soft_wrap=True)
    c = data["cache"]
    if c["entries"]:
        ct = Table(header_style="bold")
        for col, kw in (("program", {"no_wrap": True}), ("arch", {}), ("KiB", {"justify": "right"}),
                        ("cold compile s", {"justify": "right"}), ("created", {})):
            ct.add_column(col, **kw)
        for e in c["entries"]:
            ct.add_row(escape(str(e["program"])) if e["valid"] else f"[red]unreadable: {escape(e['file'])}[/]",
                       str(e["arch"] or ""), f"{e['size'] / 1024:.0f}",
                       f"{e['compile_seconds']:.1f}" if e["compile_seconds"] else "", str(e["created"] or ""))
        out.print(ct)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
