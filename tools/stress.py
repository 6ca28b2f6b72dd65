"""Many default calls, each process fresh, for failures that come only now and then (a launch
failure, a hang): what a single test run does not show.

    python tools/stress.py [--processes 40] [--dtype fp8] [--shapes 4096x8x1,4096x16x1,8192x8x2]
                           [--batch 128] [--calls 100] [--timeout 30] [--topk N] [--page-size P]
                           [--lengths random|fixed]

Each process (a new seed each): for every shape (s_k x h_q x s_q; one KV head, causal), cache
lengths drawn from N(s_k, s_k / 2) (at least 0: about 2 % of the requests are empty, and some shorter
than s_q, whose first rows see no token under the causal mask), or with ``--lengths fixed`` all s_k (the
profiler's rows without varlen: the 16-bit kernel's hang of docs/perf-notes.md section 48 came
there, 2 profiles in 25, at s_k 16384 and 64 rows), 10 calls back to back, then --calls calls each
after a 256 MiB memset (the profiler's way of timing), one synchronization; it prints "ok", the
error, or how many calls' out and lse differ bit for bit from the first call's (the kernels are
deterministic: a difference is a race that did not crash). ``--topk N``: sparse decoding instead
(the FP8 cache of DeepSeek-V3.2, N distinct indices per query token among each request's s_k
tokens, attn_sink; the profiler's sparse inputs, seeded per process). ``--page-size P``: the dense
cache in pages of P tokens (default 64; 1 runs the one-token-page kernels). The processes run one after
another; a process that prints neither within --timeout is counted as a hang. One line per
process, then the count; exit status 1 on any failure.

The defaults are the narrow kernel's shapes (docs/perf-notes.md section 29: with the Q fragments of
b7ef514 about 40 % of these processes failed on a lent H200; fixed lengths rarely showed it).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

DEFAULT_SHAPES = "4096x8x1,4096x16x1,8192x8x2"


def cache_lengths(rng, batch: int, s_k: int, fixed: bool):
    """Each request's cache length: s_k for all, or drawn from N(s_k, s_k / 2) and at least 0."""
    import numpy as np

    if fixed:
        return np.full(batch, s_k, dtype=np.int64)
    return np.maximum(rng.normal(s_k, s_k / 2, batch).astype(np.int64), 0)


def call_for(seed: int, rng, dtype: str, batch: int, s_k: int, h_q: int, s_q: int, topk: int, page_size: int,
             fixed_lengths: bool):
    """One default call of the shape, on fresh inputs."""
    import flashmla_cupy
    from flashmla_cupy import testing

    if topk:
        from flashmla_cupy.profiler.inputs import make_sparse_inputs
        from flashmla_cupy.profiler.shapes import SparseShape
        x = make_sparse_inputs(SparseShape(batch, h_q, s_q, s_k, topk), seed=seed)
        md, ns = flashmla_cupy.get_mla_metadata(x.cache_seqlens, s_q * h_q, 1, num_heads_q=h_q, is_fp8_kvcache=True,
                                                topk=topk)
        return lambda: flashmla_cupy.flash_mla_with_kvcache(x.q, x.k_cache, None, x.cache_seqlens, 512, md, ns,
                                                            is_fp8_kvcache=True, indices=x.indices,
                                                            attn_sink=x.attn_sink)
    inp = testing.make_inputs(rng, cache_lengths(rng, batch, s_k, fixed_lengths), s_q, h_q, 1, dtype, spare_blocks=0,
                              garbage_columns=0, page_size=page_size)
    md, ns = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
    return lambda: flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512,
                                                        md, ns, causal=True, **inp.cache_kwargs())


def child(seed: int, dtype: str, shapes: list[tuple[int, int, int]], batch: int, calls: int, topk: int,
          page_size: int, fixed_lengths: bool) -> None:
    import os

    import cupy
    import numpy as np

    rng = np.random.default_rng(seed)
    flush = cupy.empty(256 << 20, dtype=np.uint8)
    stream = cupy.cuda.get_current_stream()
    bits = lambda a: a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)   # NaN == NaN, bit for bit
    for s_k, h_q, s_q in shapes:
        call = call_for(seed, rng, dtype, batch, s_k, h_q, s_q, topk, page_size, fixed_lengths)
        i = -1
        try:
            first = [bits(x).copy() for x in call()]
            differ = cupy.zeros((), dtype=np.int32)   # outputs (out, lse) that differ from the first call's
            for i in range(1, 10 + calls):
                if i >= 10:
                    cupy.cuda.runtime.memsetAsync(flush.data.ptr, i & 0xff, flush.nbytes, stream.ptr)
                for x, f in zip(call(), first):
                    differ += cupy.any(bits(x) != f)
            differing = int(differ)
        except Exception as e:  # noqa: BLE001 - any CUDA error is the finding
            print(f"FAILED s_k {s_k} h_q {h_q} s_q {s_q} (error seen at call {i}): {type(e).__name__}: {e}", flush=True)
            os._exit(1)   # the context is lost: no clean-up that would raise again
        if differing:
            print(f"FAILED s_k {s_k} h_q {h_q} s_q {s_q}: {differing} outputs (out or lse) of {9 + calls} calls differ "
                  "from the first call's (the kernels are deterministic)", flush=True)
            os._exit(1)
        del call
    print("ok", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=40)
    ap.add_argument("--dtype", default="fp8", choices=["bf16", "fp16", "fp8", "fp8q"])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="s_k x h_q x s_q, comma separated")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds a process may take")
    ap.add_argument("--seed", type=int, default=0, help="the first process's seed")
    ap.add_argument("--topk", type=int, default=0, help="sparse decoding, topk indices per query token")
    ap.add_argument("--page-size", type=int, default=64, help="dense cache: tokens per page (a power of two)")
    ap.add_argument("--lengths", default="random", choices=["random", "fixed"],
                    help="dense cache: each request's length drawn around s_k, or s_k for all")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.child is not None:
        child(args.child, args.dtype, shapes, args.batch, args.calls, args.topk, args.page_size,
              args.lengths == "fixed")
        return 0

    failures = 0
    for k in range(args.processes):
        seed = args.seed + k
        cmd = [sys.executable, __file__, "--child", str(seed), "--dtype", args.dtype, "--shapes", args.shapes,
               "--batch", str(args.batch), "--calls", str(args.calls), "--topk", str(args.topk),
               "--page-size", str(args.page_size), "--lengths", args.lengths]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            last_error = (done.stderr.strip().splitlines() or ["no output"])[-1]
            result = next((line for line in done.stdout.splitlines() if line.startswith(("ok", "FAILED"))),
                          f"FAILED: exited without a result ({last_error})")
        except subprocess.TimeoutExpired:
            result = f"FAILED: no result within {args.timeout:g} s (a hang?)"
        failures += result != "ok"
        print(f"seed {seed}: {result}", flush=True)
    print(f"{failures} of {args.processes} processes failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
