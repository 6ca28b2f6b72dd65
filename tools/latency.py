"""Small-batch latency of flash_mla_with_kvcache: back-to-back calls, host CPU time, CUDA graphs.

    python tools/latency.py [--batch 1,8,32] [--seqlen 4096] [--heads 128] [--s-q 1]
                            [--topk N] [--inputs cupy,torch] [--value-checks async|sync|off]
                            [--kernels] [--cprofile]

Dense calls (bf16/fp16 cache, causal) unless ``--topk`` asks for sparse decoding: the FP8 cache,
``topk`` distinct indices per query token among ``--seqlen`` tokens per request, attn_sink (the
profiler's sparse inputs). Each row is one shape and one way of calling (``--inputs``):
  cupy       the default call on CuPy arrays (outputs allocated by the call)
  cupy-out   the same with out=, lse= and workspace= preallocated (allocation-free)
  torch      flashmla_cupy.flash_mla (the torch drop-in) on torch tensors, torch's current stream
and it prints:
  eager us/call   GPU time per call of 200 calls issued back to back, median of 15 rounds
  cpu us/call     host time spent inside one call (no synchronization), median of 2000 calls
                  (--cprofile: and a cProfile of those calls)
  graph us/call   the call captured once in a CUDA graph, replays back to back (cupy-out only)
  python us/call  host time of one call with the two driver launches replaced by no-ops: what
                  the Python side costs (cpu minus this is the driver's launch time)
With --kernels, also each kernel of the call alone, launched back to back from the call's
prepared launch (GPU µs per launch): splitkv us, combine us.
Value checks run in their default mode ("async": no synchronization) unless --value-checks says
otherwise. No L2 flush between calls: this is the latency a decode loop sees, not a bandwidth
figure.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import cupy
import numpy as np

import flashmla_cupy
from flashmla_cupy import flash_mla, mla   # flash_mla imports torch only when used
from flashmla_cupy.testing import DTYPES


def inputs(batch, seqlen, h_q, s_q, dtype, topk):
    """``(q, k_cache, block_table, cache_seqlens, keyword arguments)`` of one call."""
    if topk:
        from flashmla_cupy.profiler.inputs import make_sparse_inputs
        from flashmla_cupy.profiler.shapes import SparseShape
        x = make_sparse_inputs(SparseShape(batch, h_q, s_q, seqlen, topk))
        return x.q, x.k_cache, None, x.cache_seqlens, dict(is_fp8_kvcache=True, indices=x.indices,
                                                           attn_sink=x.attn_sink)
    pages = -(-seqlen // 64)
    gen = cupy.random.default_rng(0)
    q = gen.standard_normal((batch, s_q, h_q, 576), dtype=np.float32).astype(dtype)
    k_cache = gen.standard_normal((batch * pages, 64, 1, 576), dtype=np.float32).astype(dtype)
    block_table = cupy.asarray(np.random.default_rng(0).permutation(batch * pages).astype(np.int32).reshape(batch, pages))
    seqlens = cupy.full((batch,), seqlen, dtype=np.int32)
    return q, k_cache, block_table, seqlens, dict(causal=True)


def gpu_us_per_call(fn, stream, n=200, rounds=15) -> float:
    """Median over rounds of the GPU time per call of n calls issued back to back."""
    times = []
    for _ in range(rounds):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(n):
            fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / n)
    return statistics.median(times)


def host_us_per_call(fn, stream, n=2000) -> float:
    """Median host time of one call (the stream is drained every 100 calls)."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i % 100 == 99:
            stream.synchronize()
    return statistics.median(times) * 1e6


def _calls(kind, batch, seqlen, h_q, s_q, dtype, topk):
    """The call to time for one way of calling (see the module docstring), its metadata and
    num_splits."""
    q, k_cache, block_table, seqlens, options = inputs(batch, seqlen, h_q, s_q, dtype, topk)
    sparse = dict(num_heads_q=h_q, is_fp8_kvcache=True, topk=topk) if topk else {}
    if kind == "torch":
        q, k_cache, block_table, seqlens = (None if x is None else flash_mla.from_cupy(x)
                                            for x in (q, k_cache, block_table, seqlens))
        options = {k: flash_mla.from_cupy(v) if isinstance(v, cupy.ndarray) else v for k, v in options.items()}
        meta, splits = flash_mla.get_mla_metadata(seqlens, s_q * h_q, 1, **sparse)
        return (lambda: flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, splits,
                                                         **options)), meta, splits
    meta, splits = flashmla_cupy.get_mla_metadata(seqlens, s_q * h_q, 1, **sparse)
    if kind == "cupy-out":
        options.update(out=cupy.empty((batch, s_q, h_q, 512), dtype=q.dtype),
                       lse=cupy.empty((batch, h_q, s_q), dtype=np.float32),
                       workspace=flashmla_cupy.get_mla_workspace(q, k_cache, meta, sparse=bool(topk)))
    return (lambda: flashmla_cupy.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, splits,
                                                         **options)), meta, splits


def measure(kind, batch, seqlen, h_q, s_q, dtype, topk, stream, cprofile=False, kernels=False):
    # No plans from earlier shapes: the one left after the calls below is this call's (a plan kept
    # from another batch holds the addresses of that batch's freed arrays).
    mla._plans.clear()
    call, meta, splits = _calls(kind, batch, seqlen, h_q, s_q, dtype, topk)
    for _ in range(20):
        call()
    stream.synchronize()

    eager = gpu_us_per_call(call, stream)
    cpu_us = host_us_per_call(call, stream)
    if cprofile:
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        profiler.enable()
        for i in range(2000):
            call()
            if i % 100 == 99:
                stream.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)

    graph_us = float("nan")
    if kind == "cupy-out":
        stream.begin_capture()
        call()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        graph_us = gpu_us_per_call(lambda: graph.launch(stream), stream)
    result = {"eager": eager, "cpu": cpu_us, "graph": graph_us, "splits": int(cupy.asnumpy(cupy.asarray(splits))[-1])}

    # The call's plan (the only one: all calls above share one layout) and its launches.
    (plan,) = mla._plans.values()
    launches = (plan.splitkv, plan.combine)
    if kernels:
        result["splitkv"], result["combine"] = (gpu_us_per_call(launch, stream) for launch in launches)
    real = [launch._launch for launch in launches]
    try:
        for launch in launches:
            launch._launch = lambda *args: 0
        result["python"] = host_us_per_call(call, stream)
    finally:
        for launch, fn in zip(launches, real):
            launch._launch = fn
    flashmla_cupy.check_errors()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--s-q", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--topk", type=int, default=0, help="sparse decoding over the FP8 cache, topk indices per token")
    ap.add_argument("--inputs", default="cupy,cupy-out,torch",
                    help="ways of calling, comma-separated: cupy, cupy-out, torch (default: all)")
    ap.add_argument("--value-checks", choices=["async", "sync", "off"], default=None,
                    help="value check mode (default: the library's, async)")
    ap.add_argument("--cprofile", action="store_true", help="also print where the host time of a call goes")
    ap.add_argument("--kernels", action="store_true", help="also time each kernel of the call alone")
    args = ap.parse_args()
    stream = cupy.cuda.Stream(non_blocking=True)
    mode = args.value_checks or flashmla_cupy.value_check_mode()
    print(f"value checks: {mode}" + (f"; sparse decoding, topk {args.topk}" if args.topk else ""))
    print(f"{'inputs':>8} {'b':>4} {'s_k':>6} {'h_q':>4} {'s_q':>3} {'splits':>6} "
          f"{'eager us/call':>14} {'cpu us/call':>12} {'python us/call':>15} {'graph us/call':>14}"
          + (f" {'splitkv us':>11} {'combine us':>11}" if args.kernels else ""))
    with stream, flashmla_cupy.value_checks(mode), _torch_on(stream):
        for kind in args.inputs.split(","):
            for batch in [int(x) for x in args.batch.split(",")]:
                r = measure(kind, batch, args.seqlen, args.heads, args.s_q, DTYPES[args.dtype], args.topk, stream,
                            args.cprofile, args.kernels)
                print(f"{kind:>8} {batch:>4} {args.seqlen:>6} {args.heads:>4} {args.s_q:>3} {r['splits']:>6} "
                      f"{r['eager']:>14.1f} {r['cpu']:>12.1f} {r['python']:>15.1f} {r['graph']:>14.1f}"
                      + (f" {r['splitkv']:>11.1f} {r['combine']:>11.1f}" if args.kernels else ""), flush=True)


def _torch_on(stream):
    """torch's current stream = ``stream`` (where torch can run), so that every way of calling
    runs on the stream the events time."""
    return contextlib.nullcontext() if flash_mla.torch_unavailable() else flash_mla.cupy_stream(stream)


if __name__ == "__main__":
    main()
