"""Small-batch latency of flash_mla_with_kvcache: back-to-back calls, host CPU time, CUDA graphs.

    python tools/latency.py [--batch 1,8,32] [--seqlen 4096] [--heads 128] [--s-q 1]
                            [--overheads 5,10,20]

For each shape (and each scheduler overhead constant, an experiment knob of the tile
scheduler: the cost in pages charged per request) it prints:
  eager us/call   GPU time per call of 200 calls issued back to back through the Python API
                  (out, lse and workspace preallocated, value checks off), median of 15 rounds
  cpu us/call     host time spent inside one call (no synchronization), median of 2000 calls
                  (--cprofile: and a cProfile of those calls)
  graph us/call   the same call captured once in a CUDA graph, replays back to back
No L2 flush between calls: this is the latency a decode loop sees, not a bandwidth figure.
"""
from __future__ import annotations

import argparse
import statistics
import time

import cupy
import numpy as np

import flashmla_cupy
from flashmla_cupy import checks, scheduler
from flashmla_cupy.testing import DTYPES


def inputs(batch, seqlen, h_q, s_q, dtype):
    pages = -(-seqlen // 64)
    gen = cupy.random.default_rng(0)
    q = gen.standard_normal((batch, s_q, h_q, 576), dtype=np.float32).astype(dtype)
    k_cache = gen.standard_normal((batch * pages, 64, 1, 576), dtype=np.float32).astype(dtype)
    block_table = cupy.asarray(np.random.default_rng(0).permutation(batch * pages).astype(np.int32).reshape(batch, pages))
    seqlens = cupy.full((batch,), seqlen, dtype=np.int32)
    return q, k_cache, block_table, seqlens


def measure(batch, seqlen, h_q, s_q, dtype, overhead, stream, cprofile=False):
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

    n = 200
    rounds = []
    for _ in range(15):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(n):
            call()
        end.record(stream)
        end.synchronize()
        rounds.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / n)
    eager = statistics.median(rounds)

    cpu = []
    for i in range(2000):
        t0 = time.perf_counter()
        call()
        cpu.append(time.perf_counter() - t0)
        if i % 100 == 99:
            stream.synchronize()
    cpu_us = statistics.median(cpu) * 1e6
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
    rounds = []
    for _ in range(15):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(n):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
        rounds.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / n)
    return eager, cpu_us, statistics.median(rounds), int(cupy.asnumpy(splits)[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--s-q", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--overheads", default=str(scheduler.FIXED_OVERHEAD_BLOCKS))
    ap.add_argument("--cprofile", action="store_true", help="also print where the host time of a call goes")
    args = ap.parse_args()
    stream = cupy.cuda.Stream(non_blocking=True)
    print(f"{'b':>4} {'s_k':>6} {'h_q':>4} {'s_q':>3} {'overhead':>8} {'splits':>6} "
          f"{'eager us/call':>14} {'cpu us/call':>12} {'graph us/call':>14}")
    with stream, checks.value_checks(False):
        for overhead in [int(x) for x in args.overheads.split(",")]:
            for batch in [int(x) for x in args.batch.split(",")]:
                eager, cpu, graph, splits = measure(batch, args.seqlen, args.heads, args.s_q,
                                                    DTYPES[args.dtype], overhead, stream, args.cprofile)
                print(f"{batch:>4} {args.seqlen:>6} {args.heads:>4} {args.s_q:>3} {overhead:>8} {splits:>6} "
                      f"{eager:>14.1f} {cpu:>12.1f} {graph:>14.1f}", flush=True)


if __name__ == "__main__":
    main()
