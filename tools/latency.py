"""Small-batch latency of flash_mla_with_kvcache: back-to-back calls, host CPU time, CUDA graphs.

    python tools/latency.py [--batch 1,8,32] [--seqlen 4096] [--heads 128] [--s-q 1]
                            [--overheads 5,10,20] [--kernels] [--cprofile]

For each shape (and each scheduler overhead constant, an experiment knob of the tile
scheduler: the cost in pages charged per request) it prints:
  eager us/call   GPU time per call of 200 calls issued back to back through the Python API
                  (out, lse and workspace preallocated, value checks off), median of 15 rounds
  cpu us/call     host time spent inside one call (no synchronization), median of 2000 calls
                  (--cprofile: and a cProfile of those calls)
  graph us/call   the same call captured once in a CUDA graph, replays back to back
  python us/call  host time of one call with the two driver launches replaced by no-ops: what
                  the Python side costs (cpu minus this is the driver's launch time)
With --kernels, also each kernel of the call alone, launched back to back from the call's
prepared launch (GPU µs per launch): splitkv us, combine us.
No L2 flush between calls: this is the latency a decode loop sees, not a bandwidth figure.
"""
from __future__ import annotations

import argparse
import statistics
import time

import cupy
import numpy as np

import flashmla_cupy
from flashmla_cupy import checks, mla, scheduler
from flashmla_cupy.testing import DTYPES


def inputs(batch, seqlen, h_q, s_q, dtype):
    pages = -(-seqlen // 64)
    gen = cupy.random.default_rng(0)
    q = gen.standard_normal((batch, s_q, h_q, 576), dtype=np.float32).astype(dtype)
    k_cache = gen.standard_normal((batch * pages, 64, 1, 576), dtype=np.float32).astype(dtype)
    block_table = cupy.asarray(np.random.default_rng(0).permutation(batch * pages).astype(np.int32).reshape(batch, pages))
    seqlens = cupy.full((batch,), seqlen, dtype=np.int32)
    return q, k_cache, block_table, seqlens


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


def measure(batch, seqlen, h_q, s_q, dtype, overhead, stream, cprofile=False, kernels=False):
    scheduler_default = scheduler.FIXED_OVERHEAD_BLOCKS
    scheduler.FIXED_OVERHEAD_BLOCKS = overhead
    try:
        q, k_cache, block_table, seqlens = inputs(batch, seqlen, h_q, s_q, dtype)
        meta, splits = flashmla_cupy.get_mla_metadata(seqlens, s_q * h_q, 1)
    finally:
        scheduler.FIXED_OVERHEAD_BLOCKS = scheduler_default
    out = cupy.empty((batch, s_q, h_q, 512), dtype=dtype)
    lse = cupy.empty((batch, h_q, s_q), dtype=np.float32)
    ws = flashmla_cupy.get_mla_workspace(q, k_cache, meta)

    def call():
        flashmla_cupy.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, splits,
                                             causal=True, out=out, lse=lse, workspace=ws)

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

    stream.begin_capture()
    call()
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    result = {"eager": eager, "cpu": cpu_us, "graph": gpu_us_per_call(lambda: graph.launch(stream), stream),
              "splits": int(cupy.asnumpy(splits)[-1])}

    # The call's plan (looked up as the call does) and its two prepared launches.
    plan = mla._plans[mla._plan_key(q, k_cache, block_table, seqlens, meta, splits, 512, None, True)]
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
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--s-q", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--overheads", default=str(scheduler.FIXED_OVERHEAD_BLOCKS))
    ap.add_argument("--cprofile", action="store_true", help="also print where the host time of a call goes")
    ap.add_argument("--kernels", action="store_true", help="also time each kernel of the call alone")
    args = ap.parse_args()
    stream = cupy.cuda.Stream(non_blocking=True)
    print(f"{'b':>4} {'s_k':>6} {'h_q':>4} {'s_q':>3} {'overhead':>8} {'splits':>6} "
          f"{'eager us/call':>14} {'cpu us/call':>12} {'python us/call':>15} {'graph us/call':>14}"
          + (f" {'splitkv us':>11} {'combine us':>11}" if args.kernels else ""))
    with stream, checks.value_checks(False):
        for overhead in [int(x) for x in args.overheads.split(",")]:
            for batch in [int(x) for x in args.batch.split(",")]:
                r = measure(batch, args.seqlen, args.heads, args.s_q, DTYPES[args.dtype], overhead, stream,
                            args.cprofile, args.kernels)
                print(f"{batch:>4} {args.seqlen:>6} {args.heads:>4} {args.s_q:>3} {overhead:>8} {r['splits']:>6} "
                      f"{r['eager']:>14.1f} {r['cpu']:>12.1f} {r['python']:>15.1f} {r['graph']:>14.1f}"
                      + (f" {r['splitkv']:>11.1f} {r['combine']:>11.1f}" if args.kernels else ""), flush=True)


if __name__ == "__main__":
    main()
