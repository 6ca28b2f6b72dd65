"""The ``compile`` subcommand: build (or find cached) cubins for every kernel program.

Programs come from the registry (``flashmla_cupy.programs``). Missing cubins compile in parallel
processes (``compiler.build_many``); each program's row gives per kernel the registers and stack
read from the cubin, the spills from ptxas's report, the cold compile time (recorded in the cache
entry when it was built) and where the cubin came from (shipped in the wheel, the cache, or
compiled now). Needs no GPU when ``arch`` is given.
"""
from __future__ import annotations

import time


def collect_programs(kind: str | None = None) -> list:
    """Every program (``kind`` "mla": the MLA ones; "attention": the minimal FlashAttention's)."""
    from .. import attention, programs
    if kind == "mla":
        return programs.mla_programs()
    if kind == "attention":
        return attention.all_programs()
    return programs.all_programs()


def default_arch(device: int = 0) -> tuple[str, str]:
    """(arch, where it came from): the GPU's, else sm_90a."""
    from .. import compiler
    try:
        from .env import device_info, gpu_count
        if gpu_count() > device:
            return device_info(device)["arch"], f"device {device}"
    except Exception:  # noqa: BLE001 - no GPU
        pass
    return compiler.DEFAULT_ARCH, "default (no GPU)"


def filter_programs(programs: list, only: list[str] | None) -> list:
    if not only:
        return programs
    return [p for p in programs if any(s.lower() in p.name.lower() for s in only)]


def build_with_progress(programs: list, arch: str, jobs: int | None, console, *,
                        transient: bool = False, show_hits: bool = True) -> tuple[list, float]:
    """Build with a rich progress bar; ``(cubins, wall seconds)``. Raises ``CompileError``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .. import compiler

    t0 = time.perf_counter()
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=transient,
                  disable=not console.is_terminal) as progress:     # no bars in logs and pipes
        task = progress.add_task(f"building {len(programs)} kernel program(s) for {arch}", total=len(programs))

        def done(cubin):
            if show_hits or not cubin.from_cache:
                how = ("bundled" if cubin.bundled else "cache hit" if cubin.from_cache
                       else f"compiled in {cubin.compile_seconds:.1f} s")
                progress.console.print(f"  {cubin.program.name}: {how}", highlight=False)
            progress.advance(task)

        cubins = compiler.build_many(programs, arch, jobs=jobs, on_done=done)
    return cubins, time.perf_counter() - t0


def short_kernel_name(expr: str) -> str:
    """``flashmla::mla_combine_kernel<cutlass::bfloat16_t>`` -> ``mla_combine_kernel<bfloat16_t>``."""
    head, sep, args = expr.partition("<")
    name = head.split("::")[-1]
    if not sep:
        return name
    return name + "<" + ", ".join(a.strip().split("::")[-1] for a in args.rstrip(">").split(",")) + ">"


def _stack_text(r) -> str:
    """The kernel's stack frame, and the stack with its callees where that is more."""
    if r.cumulative_stack_bytes > r.stack_bytes:
        return f"{r.stack_bytes} ({r.cumulative_stack_bytes} with calls)"
    return str(r.stack_bytes)


def _spill_text(r) -> str:
    """Spill stores/loads from ptxas's report; where the log has none, the cubin's stack still
    rules spills out when it is 0 bytes, since spills live there."""
    if r.spills_reported:
        return f"{r.spill_stores}/{r.spill_loads}"
    return "none (0 B stack)" if max(r.stack_bytes, r.cumulative_stack_bytes) == 0 else "not reported"


def resources_table(cubins: list, arch: str):
    from rich.table import Table

    t = Table(title=f"kernels for {arch} (registers and stack from the cubin, spills from ptxas)", header_style="bold")
    t.add_column("kernel", overflow="fold", ratio=1)
    for name in ("regs", "stack B", "spill st/ld B", "KiB", "cold s"):
        t.add_column(name, justify="right", no_wrap=True)
    t.add_column("cache", no_wrap=True)
    for c in cubins:
        for i, expr in enumerate(c.program.kernels):
            r = c.resources.get(expr)
            known = r is not None and r.registers >= 0
            warn = known and (r.spill_stores > 0 or r.spill_loads > 0 or r.cumulative_stack_bytes > 0)
            spill_text = _spill_text(r) if known else "?"
            t.add_row(short_kernel_name(expr),
                      str(r.registers) if known else "?", _stack_text(r) if known else "?",
                      f"[yellow]{spill_text}[/]" if warn else spill_text,
                      f"{len(c.image) / 1024:.0f}" if i == 0 else "",
                      f"{c.compile_seconds:.1f}" if i == 0 else "",
                      _cache_text(c) if i == 0 else "")
    return t


def _cache_text(c) -> str:
    if c.bundled:
        return "[green]bundled[/]"
    return "[green]hit[/]" if c.from_cache else "compiled"


def records(cubins: list) -> list[dict]:
    out = []
    for c in cubins:
        for expr in c.program.kernels:
            r = c.resources.get(expr)
            out.append({"program": c.program.name, "source": c.program.source, "kernel": expr,
                        "arch": c.arch, "registers": r.registers if r else None,
                        "stack_bytes": r.stack_bytes if r else None,
                        "cumulative_stack_bytes": r.cumulative_stack_bytes if r else None,
                        "spill_stores": r.spill_stores if r else None,
                        "spill_loads": r.spill_loads if r else None,
                        "cubin_bytes": len(c.image), "compile_seconds": c.compile_seconds,
                        "from_cache": c.from_cache, "bundled": c.bundled,
                        "path": str(c.path) if c.path else None})
    return out


def profile_programs(kind: str, dtype_tag: str = "bf16", q_dtype: str | None = None,
                     page_sizes: tuple[int, ...] = (), heads: tuple[int, ...] = ()) -> list:
    """The programs a profile launches: for MLA the split-KV kernel of the cache's dtype (the
    profile's dtype names are the registry's tags: bf16, fp16, fp8; over the FP8 cache an e4m3 q,
    ``q_dtype`` fp8, has a kernel of its own; ``ONE_TOKEN_PAGE_TAGS`` in one-token pages too; with
    a bf16 q the narrow kernel's program as well, for shapes of at most 32 rows per KV head), the combine
    kernel of out's dtype (bf16 over the FP8 cache) and the metadata kernel; for sparse decoding
    the sparse FP8 split-KV kernel's forms for the profile's ``heads`` (pairs of CTAs where h_q
    makes an even number of 64-row m-blocks, a CTA alone otherwise; no heads given: both) with the
    bf16 combine and the metadata kernel; for attention the minimal FlashAttention's.
    ``page_sizes``: the profile's (none: the default, 64)."""
    from .. import programs
    from .shapes import FP8_Q, out_dtype
    if kind == "attention":
        return collect_programs("attention")
    if kind == "sparse":
        pairs = {programs.sparse_pairs(h) for h in heads} or {True, False}
        return [*(programs.splitkv_program(programs.SPARSE_FP8_TAG, alone=not p) for p in (True, False) if p in pairs),
                programs.combine_program("bf16"), programs.metadata_program()]
    splitkv_tag, out_tag = dtype_tag, out_dtype(dtype_tag)
    if splitkv_tag == programs.FP8_TAG and q_dtype == FP8_Q:
        splitkv_tag = programs.FP8_Q_TAG
    token_pages = splitkv_tag in programs.ONE_TOKEN_PAGE_TAGS and 1 in page_sizes
    splitkv = [programs.splitkv_program(splitkv_tag, one_token_pages=True)] if token_pages else []
    if not token_pages or set(page_sizes) != {1}:
        splitkv.insert(0, programs.splitkv_program(splitkv_tag))
    if splitkv_tag == programs.FP8_TAG:
        splitkv.append(programs.fp8_narrow_program())
    return [*splitkv, programs.combine_program(out_tag), programs.metadata_program()]


def prebuild(progs: list, console, *, arch: str) -> None:
    """Before a profile: build the kernels it will launch (``profile_programs``), with our own
    progress display (the compiler's own status line would collide with the profile's progress bar)."""
    from .. import bundled, compiler
    missing = [p for p in progs if bundled.lookup(p, arch) is None and not compiler.entry_path(p, arch).is_file()]
    if missing:
        console.print(f"[bold]flashmla-cupy[/] first use: compiling {len(missing)} kernel program(s) "
                      f"for {arch} with NVRTC (cached afterwards; `flashmla-cupy compile` does this ahead)")
    build_with_progress(progs, arch, None, console, transient=True, show_hits=False)
