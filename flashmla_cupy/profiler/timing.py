"""Timing: statistics over samples (pure) and CUDA-event timing of a callable.

Method (what the report's header says):

* warm-up calls first (module load, NVRTC compile on first use, tensor-map and launch-config
  caches stay out of the numbers);
* every timed run is preceded by an L2 flush: a ``cudaMemsetAsync`` over a buffer of at least
  twice the L2 size (256 MiB at least), so each run reads its inputs from device memory, as a
  decoding step that follows other layers would;
* CUDA events around the call only (the flush is outside them), all runs enqueued back to back
  and read after one synchronization, so the host does not pace the device;
* ``graph=True``: the call is captured once into a CUDA graph (CuPy stream capture) and each run
  is one ``graph.launch``: no Python launch overhead inside the events.

The median is the headline; the spread is p10–p90 (and the interquartile range in the exports).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class Stats:
    """Summary of run times in milliseconds."""
    n: int
    median: float
    p10: float
    p90: float
    q1: float
    q3: float
    mean: float
    std: float
    min: float
    max: float

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def spread_pct(self) -> float:
        """Half the p10–p90 width relative to the median, in percent."""
        return 50.0 * (self.p90 - self.p10) / self.median if self.median > 0 else math.nan

    def as_dict(self, prefix: str = "ms_") -> dict:
        return {prefix + k: v for k, v in asdict(self).items() if k != "n"} | {"n_runs": self.n}


def percentile(sorted_samples: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (NumPy's default method) of already sorted samples."""
    n = len(sorted_samples)
    if n == 0:
        raise ValueError("no samples")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside [0, 100]")
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * frac


def summarize(samples: Sequence[float]) -> Stats:
    """Median, p10/p90, quartiles, mean, standard deviation (population), min and max."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("no samples")
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / n)
    return Stats(n=n, median=percentile(xs, 50), p10=percentile(xs, 10), p90=percentile(xs, 90),
                 q1=percentile(xs, 25), q3=percentile(xs, 75), mean=mean, std=std,
                 min=xs[0], max=xs[-1])


def runs_for_budget(estimate_ms: float, repeats: int, budget_s: float, minimum: int = 10) -> int:
    """How many runs to time: ``repeats``, fewer when one run is slow (at least ``minimum``)."""
    if estimate_ms <= 0 or budget_s <= 0:
        return repeats
    fit = int(budget_s * 1000.0 / estimate_ms)
    return max(min(repeats, fit), min(minimum, repeats))


# --------------------------------------------------------------------------------------------
# On the GPU
# --------------------------------------------------------------------------------------------

MIN_FLUSH_BYTES = 256 << 20

# How the L2 is emptied before each timed run:
#   write  memset of the buffer, as triton's do_bench (FlashMLA's anchors were measured so): the
#          L2 is left full of the buffer's dirty lines, whose write-back then shares HBM with the
#          timed run (about 50 MB on an H100: ~17 us, a fixed cost that weighs on short calls);
#   read   the buffer is read (a max-reduction): the L2 is left holding clean lines, which the
#          timed run evicts for free;
#   none   no flush (warm cache: inputs may be cached).
FLUSH_MODES = ("write", "read", "none")


def flush_bytes(l2_bytes: int) -> int:
    return max(2 * int(l2_bytes), MIN_FLUSH_BYTES)


def describe_flush(mode: str, nbytes: int) -> str:
    size = f"{nbytes / 2**20:.0f} MiB"
    if mode == "write":
        return (f"L2 flushed before every run by a memset of {size} (as triton's do_bench; its dirty "
                f"lines are written back during the timed run)")
    if mode == "read":
        return f"L2 flushed before every run by reading {size} (clean lines: nothing is written back)"
    return "L2 not flushed (warm cache: inputs may be cached)"


class L2Flush:
    """A device buffer at least twice the L2's size; ``flush(stream)`` writes or reads all of it."""

    def __init__(self, l2_bytes: int, device_id: int = 0, mode: str = "write"):
        import cupy

        if mode not in ("write", "read"):
            raise ValueError(f"flush mode must be 'write' or 'read'; got {mode!r}")
        self.mode = mode
        self.nbytes = flush_bytes(l2_bytes)
        with cupy.cuda.Device(device_id):
            self._buf = cupy.zeros(self.nbytes // 8, dtype=cupy.uint64)
            self._max = cupy.empty((), dtype=cupy.uint64)

    def flush(self, stream) -> None:
        import cupy

        if self.mode == "write":
            cupy.cuda.runtime.memsetAsync(self._buf.data.ptr, 0, self.nbytes, stream.ptr)
        else:
            with stream:
                cupy.max(self._buf, out=self._max)

    def release(self) -> None:
        self._buf = self._max = None


class GraphCaptureError(RuntimeError):
    pass


def capture_graph(fn: Callable[[], object], stream):
    """Capture one call of ``fn`` on ``stream`` into a CUDA graph; ``(graph, fn's result)``.

    The result is returned so the caller keeps the output buffers (which the graph writes) alive.
    """
    try:
        with stream:
            stream.begin_capture()
            try:
                result = fn()
            finally:
                graph = stream.end_capture()
    except Exception as e:  # noqa: BLE001 - report any capture failure as one error
        raise GraphCaptureError(f"CUDA graph capture failed: {type(e).__name__}: {e}") from None
    return graph, result


def time_cuda(fn: Callable[[], object], *, stream, repeats: int = 100, warmup: int = 10,
              flush: L2Flush | None = None, graph: bool = False,
              budget_s: float = 3.0, during_timed_runs=None) -> list[float]:
    """Run times of ``fn()`` in milliseconds, measured with CUDA events on ``stream``.

    ``fn`` is called under ``with stream`` so that code
    launching on CuPy's current stream launches there. The number of runs is ``repeats``,
    reduced for slow calls so that timing one target takes about ``budget_s`` (at least 10 runs).
    ``during_timed_runs``: a context (the clock sampler's) held from the first timed run's launch to
    the last one's end.
    """
    import cupy

    # Inputs and setup ran on other streams (the legacy default one): let them finish first.
    cupy.cuda.runtime.deviceSynchronize()
    keep = None
    with stream:
        for _ in range(max(warmup, 1)):
            if flush is not None:
                flush.flush(stream)
            keep = fn()
        stream.synchronize()
        call = fn
        if graph:
            g, keep = capture_graph(fn, stream)
            call = lambda: g.launch(stream)  # noqa: E731
            call()
            stream.synchronize()

        # One timed run to size the sample.
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        if flush is not None:
            flush.flush(stream)
        e0.record(stream)
        call()
        e1.record(stream)
        e1.synchronize()
        n = runs_for_budget(cupy.cuda.get_elapsed_time(e0, e1), repeats, budget_s)

        starts = [cupy.cuda.Event() for _ in range(n)]
        ends = [cupy.cuda.Event() for _ in range(n)]
        with during_timed_runs or contextlib.nullcontext():
            for i in range(n):
                if flush is not None:
                    flush.flush(stream)
                starts[i].record(stream)
                call()
                ends[i].record(stream)
            ends[-1].synchronize()
    del keep  # outputs (and the graph) lived until every run finished
    return [cupy.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends)]


def time_event_region(fn: Callable[[], object], *, stream, repeats: int, warmup: int) -> list[float]:
    """Plain event timing without a flush (used for the ceilings, whose buffers dwarf the L2)."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    with stream:
        for _ in range(warmup):
            fn()
        starts = [cupy.cuda.Event() for _ in range(repeats)]
        ends = [cupy.cuda.Event() for _ in range(repeats)]
        for i in range(repeats):
            starts[i].record(stream)
            fn()
            ends[i].record(stream)
        ends[-1].synchronize()
    return [cupy.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends)]
