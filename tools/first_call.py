"""Wall time of the first MLA decoding call in a fresh process, and where its cubins came from.

    python tools/first_call.py [--dtype bf16|fp16] [--fresh [--limit SECONDS]]

Prints the import time, the first get_mla_metadata + flash_mla_with_kvcache (module loads,
tensor maps, launch, synchronize), a second call for comparison, and for each kernel whether its
cubin was shipped in the wheel (bundled), read from the disk cache or compiled by NVRTC.

Without options it measures what an earlier run or `flashmla-cupy compile` left in the cache.
With --fresh it measures a fresh install: an empty cache (a new temporary
FLASHMLA_CUPY_CACHE_DIR), so that every cubin must come from the wheel; it exits 1 if NVRTC
compiled anything or the first call took longer than --limit (default 1 s). It imports the
installed flashmla_cupy (e.g. a wheel from tools/build_wheel.py) and prints where it came from.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time


def one_call(flashmla_cupy, cupy, q, k_cache, block_table, seqlens):
    meta, splits = flashmla_cupy.get_mla_metadata(seqlens, q.shape[1] * q.shape[2], 1)
    out, lse = flashmla_cupy.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, splits, causal=True)
    cupy.cuda.get_current_stream().synchronize()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--fresh", action="store_true",
                    help="empty cache: every cubin from the wheel; exit 1 on a compile or a slow first call")
    ap.add_argument("--limit", type=float, default=1.0, help="--fresh: most seconds for the first call (default 1)")
    args = ap.parse_args()
    if args.fresh:
        os.environ["FLASHMLA_CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashmla-cupy-first-call-")

    t0 = time.perf_counter()
    import cupy
    import numpy as np

    import flashmla_cupy
    from flashmla_cupy import compiler, launch
    from flashmla_cupy.testing import DTYPES
    t_import = time.perf_counter() - t0

    compiled = []
    nvrtc_compile = compiler.compile_program

    def counted(program, *a, **k):
        compiled.append(program.name)
        return nvrtc_compile(program, *a, **k)

    compiler.compile_program = counted

    dtype = DTYPES[args.dtype]
    b, s_q, h_q, seqlen = 4, 2, 128, 1000
    pages = -(-seqlen // 64)
    gen = cupy.random.default_rng(0)
    q = gen.standard_normal((b, s_q, h_q, 576), dtype=np.float32).astype(dtype)
    k_cache = gen.standard_normal((b * pages, 64, 1, 576), dtype=np.float32).astype(dtype)
    block_table = cupy.arange(b * pages, dtype=np.int32).reshape(b, pages)
    seqlens = cupy.full((b,), seqlen, dtype=np.int32)
    cupy.cuda.get_current_stream().synchronize()

    t1 = time.perf_counter()
    one_call(flashmla_cupy, cupy, q, k_cache, block_table, seqlens)
    t_first = time.perf_counter() - t1
    t2 = time.perf_counter()
    one_call(flashmla_cupy, cupy, q, k_cache, block_table, seqlens)
    t_second = time.perf_counter() - t2

    print(f"flashmla_cupy {flashmla_cupy.__version__} from {os.path.dirname(flashmla_cupy.__file__)}; "
          f"CuPy {cupy.__version__}; cache {compiler.cache_dir()}")
    print(f"import {t_import * 1e3:.0f} ms; first call (metadata + decode, {args.dtype}) "
          f"{t_first * 1e3:.0f} ms; second call {t_second * 1e3:.1f} ms")
    for kernel in launch._kernels.values():
        c = kernel.cubin
        origin = ("bundled in the wheel" if c.bundled else "disk cache" if c.from_cache
                  else f"compiled by NVRTC in {c.compile_seconds:.1f} s")
        print(f"  {kernel.program.name}: {origin}")
    if not args.fresh:
        return 0
    failures = []
    if compiled:
        failures.append(f"NVRTC compiled {', '.join(compiled)}")
    if t_first > args.limit:
        failures.append(f"the first call took {t_first:.2f} s > {args.limit:g} s")
    print("FAIL: " + "; ".join(failures) if failures else
          f"OK: no NVRTC compile, first call {t_first * 1e3:.0f} ms <= {args.limit:g} s")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
