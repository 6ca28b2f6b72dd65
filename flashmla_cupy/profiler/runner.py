"""The profile loops: for each shape, allocate inputs, set every target up, time it, free.

Results are flat records (dicts; one per shape and target) that ``report`` turns into the table,
CSV, JSON and plot. A failing target records its one-line error and the loop goes on; a target that
does not apply to a shape (``Target.supports``) records why under ``skipped``, untimed; Ctrl-C stops
the loop and keeps what was measured. A workload with anchors (``anchors``: FlashMLA's times from
another run) adds a record for them after the measured ones, as its baseline.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from . import anchors
from . import ceilings as ceil_mod
from . import shapes as shp
from .clocks import ClockSampler, clock_note
from .env import NoGPU, _first_line
from .targets import ATTENTION_TARGETS, MLA_TARGETS, SPARSE_TARGETS, TARGETS, Target
from .timing import L2Flush, describe_flush, flush_bytes, summarize, time_cuda

# --check passes under these (FlashMLA's test requires cos_diff < 1e-5 for out and lse; an e4m3 q:
# reference.COS_DIFF_LIMITS).
COS_DIFF_LIMIT = 1e-5
# float32 attention against float64: max |error| under this passes.
ATTENTION_MAX_ABS_LIMIT = 1e-3


@dataclass
class RunConfig:
    targets: list[str]
    baseline: str | None = None
    repeats: int = 100
    warmup: int = 10
    budget_s: float = 3.0
    graph: bool = False
    flush: str = "write"                # L2 flush before each run: write, read or none (timing.FLUSH_MODES)
    check: bool = False
    seed: int = 0
    device: int = 0
    measure_ceilings: bool = True
    matmul_dtype: str = "bf16"          # the matmul ceiling's dtype: bf16 (MLA, sparse) or fp32 (attention)
    inputs: str = "cupy"                # MLA: the main target's arrays, cupy or torch (targets.MAIN_MLA_TARGETS)
    value_checks: str | None = None     # MLA, sparse: value check mode during the run (None: the library's current one)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunResult:
    kind: str                               # "mla", "sparse" or "attention"
    records: list[dict]
    ceilings: ceil_mod.Ceilings
    method: dict
    interrupted: bool = False
    skipped_targets: dict[str, str] = field(default_factory=dict)


INPUTS_TEXT = {
    "cupy": "CuPy arrays (flashmla_cupy.flash_mla_with_kvcache)",
    "torch": "torch tensors (flashmla_cupy.flash_mla, the drop-in; DLPack views of the same buffers; "
             "torch's current stream set to the profiler's)",
}


def value_check_mode(config: RunConfig) -> str:
    """The value check mode the run uses: the configured one, else the library's current one."""
    if config.value_checks:
        return config.value_checks
    from .. import value_check_mode as current
    return current()


def method_description(config: RunConfig, l2_bytes: int, kind: str) -> dict:
    if kind != "attention":
        mode = value_check_mode(config)
        call = "default call" if kind == "mla" else "default call with indices (FP8 cache, attention sink)"
        what = (f"{call}: value checks in their current mode ({mode}"
                + (", not synchronizing inside the graph" if mode == "sync" and config.graph else "")
                + f"), on {INPUTS_TEXT.get(config.inputs, config.inputs)}, outputs allocated by the call: "
                  "split-KV + combine kernels; metadata computed once beforehand")
    else:
        what = "whole call of each implementation (outputs allocated inside)"
    timing = ("CUDA events around each replay of a CUDA graph captured from one call"
              if config.graph else "CUDA events around each call, runs enqueued back to back")
    cache = describe_flush(config.flush, flush_bytes(l2_bytes))
    table = TARGETS[kind]
    extra = {}
    if kind != "attention":
        extra = {"inputs": config.inputs, "value_checks": value_check_mode(config)}
    if config.baseline and config.baseline in table:
        extra["baseline"] = (f"{config.baseline}: {table[config.baseline].description}; "
                             f"speed-up = its median / {config.targets[0]}'s")
    return {
        "timed": what,
        "timing": timing,
        "cache": cache,
        "warmup_calls": config.warmup,
        "repeats": config.repeats,
        "budget_s_per_target": config.budget_s,
        "statistic": "median; spread p10-p90 (quartiles in the exports)",
        **extra,
    }


def usable_targets(names: list[str], table: dict[str, Target]) -> tuple[list[Target], dict[str, str]]:
    ok, skipped = [], {}
    for n in names:
        t = table[n]
        why = t.requires()
        if why:
            skipped[n] = why
        else:
            ok.append(t)
    return ok, skipped


def _errors(got, ref) -> dict:
    from .. import reference

    cos = getattr(reference, "cos_diff")
    mae = getattr(reference, "max_abs_error")
    return {"cos_diff": cos(got, ref), "max_abs": mae(got, ref)}


def _rate_fields(ms: float, flops: int, nbytes: int, c: ceil_mod.Ceilings) -> dict:
    tflops = flops / (ms * 1e-3) / 1e12
    gbps = nbytes / (ms * 1e-3) / 1e9
    fb, ff = ceil_mod.fractions(gbps, tflops, c)
    bound = ceil_mod.classify(ms, flops, nbytes, c)
    return {"tflops": tflops, "gbps": gbps, "bw": gbps, "frac_copy_bw": fb, "frac_matmul": ff,
            "bound": bound.kind, "t_memory_ms": bound.t_memory_ms, "t_compute_ms": bound.t_compute_ms,
            "roof_fraction": bound.roof_fraction}


def _add_speedups(records: list[dict], main: str, baseline: str | None) -> None:
    if not baseline:
        return
    by_shape: dict[int, dict[str, dict]] = {}
    for r in records:
        by_shape.setdefault(r["shape_index"], {})[r["name"]] = r
    for rows in by_shape.values():
        m, b = rows.get(main), rows.get(baseline)
        if m and b and m.get("ms_median") and b.get("ms_median"):
            m["speedup"] = b["ms_median"] / m["ms_median"]
            m["speedup_vs"] = baseline


def require_device(config: RunConfig, need_hopper: bool) -> dict:
    """Device facts, or ``NoGPU`` with a one-line reason."""
    from .env import device_info, gpu_count

    n = gpu_count()
    if config.device >= n:
        raise NoGPU(f"device {config.device} does not exist ({n} CUDA device(s))")
    info = device_info(config.device)
    if need_hopper and not info["compute_capability"].startswith("9."):
        raise NoGPU(f"the MLA kernels (dense and sparse) need a Hopper GPU (sm_90); device {config.device} is "
                    f"{info['name']} (sm_{info['compute_capability'].replace('.', '')})")
    return info


@dataclass(frozen=True)
class Workload:
    """What differs between the MLA grid, the sparse rows and the attention sweep; ``run`` does the rest."""
    kind: str
    table: dict[str, Target]
    make_inputs: Callable            # (shape, seed) -> inputs
    reference: Callable              # inputs -> float64 reference (for --check)
    compare: Callable                # (target result, reference) -> error fields
    flops: Callable                  # shape -> FLOPs
    nbytes: Callable                 # inputs -> bytes (sparse counts the tokens its drawn indices name)
    fields: Callable                 # shape -> the record's shape fields (seed columns first)
    anchor_ms: Callable | None = None    # (shape, GPU name) -> FlashMLA's ms from another run, or None
    ceiling_notes: tuple[str, ...] = ()  # lines said with the ceilings (e.g. why one is not measured)


def _mla_reference(inp):
    """(out, lse, their cos_diff limits): an e4m3 q has its own (reference.COS_DIFF_LIMITS)."""
    from .. import reference
    s = inp.shape
    out, lse = reference.mla_decode(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, s.dv,
                                    causal=s.causal, k_scale=inp.k_scale, q_scale=inp.q_scale)
    limits = reference.COS_DIFF_LIMITS["fp8q"] if inp.q_scale is not None else (COS_DIFF_LIMIT, COS_DIFF_LIMIT)
    return out, lse, limits


def _mla_compare(result, ref) -> dict:
    eo, el = _errors(result[0], ref[0]), _errors(result[1], ref[1])
    out_limit, lse_limit = ref[2]
    return {"cos_diff_out": eo["cos_diff"], "max_abs_out": eo["max_abs"],
            "cos_diff_lse": el["cos_diff"], "max_abs_lse": el["max_abs"],
            "check_ok": bool(eo["cos_diff"] < out_limit and (lse_limit is None or el["cos_diff"] < lse_limit))}


def _mla_fields(shape: shp.MLAShape) -> dict:
    return {"batch": shape.batch, "seqlen": round(shape.seqlen_mean), "head": shape.h_q, **shape.as_dict()}


def _sparse_reference(inp):
    from .. import reference
    out, lse = reference.mla_decode_sparse(inp.q, inp.k_cache, inp.indices, attn_sink=inp.attn_sink)
    return out, lse, (COS_DIFF_LIMIT, COS_DIFF_LIMIT)


def _sparse_fields(shape: shp.SparseShape) -> dict:
    return {"batch": shape.batch, "seqlen": shape.s_k, "head": shape.h_q, **shape.as_dict()}


def _attention_compare(result, ref) -> dict:
    out = result[0] if isinstance(result, tuple) else result
    e = _errors(out, ref)
    return {"cos_diff_out": e["cos_diff"], "max_abs_out": e["max_abs"],
            "check_ok": bool(e["max_abs"] < ATTENTION_MAX_ABS_LIMIT)}


def _attention_fields(shape: shp.AttentionShape) -> dict:
    return {"batch": shape.batch, "seqlen": shape.seqlen, "head": shape.heads, **shape.as_dict()}


def mla_workload(dtype: str = "bf16") -> Workload:
    """The MLA grid of a dtype; over the FP8 cache the ceilings say that no FP8 one is measured (the
    kernel multiplies in 16 bits: the bf16 matmul is its roof, as for the sparse rows)."""
    from .inputs import make_mla_inputs
    return Workload("mla", MLA_TARGETS, make_mla_inputs, _mla_reference, _mla_compare,
                    shp.mla_flops, lambda inp: shp.mla_bytes(inp.shape), _mla_fields,
                    ceiling_notes=(ceil_mod.NO_FP8_MATMUL,) if dtype == shp.FP8_CACHE else ())


def sparse_workload() -> Workload:
    """The sparse rows: the same out/lse comparison as MLA's, FlashMLA's anchors as the baseline."""
    from .inputs import make_sparse_inputs
    return Workload("sparse", SPARSE_TARGETS, make_sparse_inputs, _sparse_reference, _mla_compare,
                    shp.sparse_flops, lambda inp: shp.sparse_bytes(inp.shape, inp.retrieved_tokens),
                    _sparse_fields, anchor_ms=anchors.flash_mla_sparse_ms,
                    ceiling_notes=(ceil_mod.NO_FP8_MATMUL,))


def attention_workload() -> Workload:
    from .inputs import make_attention_inputs
    return Workload("attention", ATTENTION_TARGETS, make_attention_inputs, _attention_reference,
                    _attention_compare, shp.attention_flops, lambda inp: shp.attention_bytes(inp.shape),
                    _attention_fields)


def workload(kind: str, dtype: str = "bf16") -> Workload:
    """The workload of a profile kind: "mla" (of a dtype), "sparse" or "attention"."""
    if kind == "mla":
        return mla_workload(dtype)
    return {"sparse": sparse_workload, "attention": attention_workload}[kind]()


class CudaSession:
    """The device side of a run: current device, one non-blocking stream, the ceilings, the L2
    flush buffer, timing and freeing memory. ``run`` talks to the GPU only through this (the CPU
    tests hand it a stand-in)."""

    def __init__(self, config: RunConfig, gpu: dict):
        self.config, self.gpu = config, gpu
        self.stream = self.flush = self.clocks = None
        self.clock_note = "not sampled"
        self._device = None

    def __enter__(self):
        import cupy

        self._device = cupy.cuda.Device(self.config.device)
        self._device.__enter__()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        if self.config.flush != "none":
            self.flush = L2Flush(self.gpu.get("l2_bytes", 0), self.config.device, self.config.flush)
        self.clocks, self.clock_note = ClockSampler.open(self._device.pci_bus_id)
        return self

    def __exit__(self, *exc):
        if self.clocks is not None:
            self.clocks.close()
        if self.flush is not None:
            self.flush.release()
        try:
            self.free()
        except Exception:  # noqa: BLE001 - a broken context already reported its error
            pass
        self._device.__exit__(*exc)
        return False

    def ceilings(self) -> ceil_mod.Ceilings:
        if not self.config.measure_ceilings:
            return ceil_mod.Ceilings(notes=["not measured (--no-ceilings)"])
        sampling = self.clocks.sampling() if self.clocks else None
        c = ceil_mod.measure(self.stream, matmul_dtype=self.config.matmul_dtype, during_matmul=sampling)
        if c.matmul_tflops and sampling:
            c.notes.append(clock_note("matmul ceiling", sampling.stats()))
        return c

    def time(self, fn) -> tuple[list[float], dict]:
        """The run times (ms) and the clock fields of the timed runs (none where not sampled)."""
        c = self.config
        sampling = self.clocks.sampling() if self.clocks else None
        times = time_cuda(fn, stream=self.stream, repeats=c.repeats, warmup=c.warmup, flush=self.flush,
                          graph=c.graph, budget_s=c.budget_s, during_timed_runs=sampling)
        return times, sampling.stats() if sampling else {}

    def free(self) -> None:
        import cupy

        from .inputs import free_gpu_memory

        cupy.cuda.runtime.deviceSynchronize()
        free_gpu_memory()


def _value_checks(config: RunConfig):
    """The configured value check mode for the run's duration (restored afterwards)."""
    if not config.value_checks:
        return contextlib.nullcontext()
    from .. import value_checks
    return value_checks(config.value_checks)


def run(work: Workload, shape_list: list, config: RunConfig, *, gpu: dict,
        on_progress: Callable[[str], None] = lambda msg: None,
        on_record: Callable[[dict], None] = lambda rec: None,
        on_note: Callable[[str], None] = lambda msg: None,
        session: CudaSession | None = None) -> RunResult:
    """Measure the ceilings, then every (shape, target): one record each.

    ``on_progress(stage)`` names what runs now, ``on_record(record)`` follows each finished
    (shape, target), ``on_note(line)`` reports a skipped target or a failure.
    """
    targets, skipped = usable_targets(config.targets, work.table)
    for n, why in skipped.items():
        on_note(f"target {n} skipped: {why}")
    measured = {t.name for t in targets}        # with FlashMLA's own call among them, no anchors
    records: list[dict] = []
    interrupted = False
    with _value_checks(config), (session or CudaSession(config, gpu)) as dev:
        on_progress("measuring the ceilings (copy bandwidth, matmul)")
        c = dev.ceilings()
        c.notes.extend(work.ceiling_notes)
        method = {**method_description(config, gpu.get("l2_bytes", 0), work.kind), "clocks": dev.clock_note}
        try:
            for i, shape in enumerate(shape_list):
                on_progress(f"{shape.label()}: inputs")
                flops = work.flops(shape)
                try:
                    inp = work.make_inputs(shape, seed=config.seed + i)
                except Exception as e:  # noqa: BLE001 - out of memory, most likely: next shape
                    on_note(f"{shape.label()}: inputs failed: {_first_line(e)}")
                    for t in targets:
                        records.append({"name": t.name, **work.fields(shape), "shape_index": i, "flops": flops,
                                        "graph": config.graph, "error": f"inputs: {_first_line(e)}"})
                        on_record(records[-1])
                    dev.free()
                    continue
                nbytes = work.nbytes(inp)
                ref = None
                if config.check:
                    on_progress(f"{shape.label()}: float64 reference")
                    try:
                        ref = work.reference(inp)
                    except Exception as e:  # noqa: BLE001
                        on_note(f"{shape.label()}: reference failed: {_first_line(e)}")
                for t in targets:
                    on_progress(f"{shape.label()}: {t.name}")
                    records.append(_measure_target(t, inp, ref, work, dev, c, config, i, shape,
                                                   flops, nbytes, on_note))
                    on_record(records[-1])
                anchor_ms = (work.anchor_ms(shape, gpu.get("name", ""))
                             if work.anchor_ms and anchors.TARGET not in measured else None)
                if anchor_ms is not None:
                    records.append({"name": anchors.TARGET, **work.fields(shape), "shape_index": i, "flops": flops,
                                    "bytes": nbytes, "ms_median": anchor_ms, "notes": anchors.NOTE,
                                    **_rate_fields(anchor_ms, flops, nbytes, c)})
                del inp, ref
                dev.free()
        except KeyboardInterrupt:
            interrupted = True
    _add_speedups(records, config.targets[0], config.baseline or (anchors.TARGET if work.anchor_ms else None))
    return RunResult(work.kind, records, c, method, interrupted, skipped)


def _measure_target(t: Target, inp, ref, work: Workload, dev, c: ceil_mod.Ceilings, config: RunConfig,
                    index: int, shape, flops: int, nbytes: int, on_note) -> dict:
    rec = {"name": t.name, **work.fields(shape), "shape_index": index, "flops": flops, "bytes": nbytes,
           "graph": config.graph}
    why = t.supports(shape)
    if why:
        rec["skipped"] = why
        return rec
    try:
        prep = t.setup(inp)
        if ref is not None:
            rec.update(work.compare(prep.result, ref))
        prep.result = None
        with prep.on_stream(dev.stream) if prep.on_stream else contextlib.nullcontext():
            times, clock_fields = dev.time(prep.run)
        stats = summarize(times).as_dict()
        rec.update(stats)
        rec.update(clock_fields)
        rec.update(_rate_fields(stats["ms_median"], flops, nbytes, c))
        if prep.notes:
            rec["notes"] = "; ".join(prep.notes)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
        rec["error"] = _first_line(e)
        on_note(f"{shape.label()} {t.name}: {rec['error']}")
    return rec


def _attention_reference(inp, max_bytes: int = 4 << 30):
    """float64 reference, a slice of the batch at a time so the N² scores stay under ``max_bytes``."""
    from .. import reference
    from ..baselines import _xp

    s = inp.shape
    per_batch = 8 * s.heads * s.seqlen * s.seqlen * 3          # scores, weights, a temporary
    step = max(1, max_bytes // max(per_batch, 1))
    out = _xp(inp.q).empty((s.batch, s.heads, s.seqlen, s.head_dim), dtype=np.float64)
    for lo in range(0, s.batch, step):
        hi = min(s.batch, lo + step)
        o, _ = reference.attention(inp.q[lo:hi], inp.k[lo:hi], inp.v[lo:hi], causal=s.causal)
        out[lo:hi] = o
    return out


