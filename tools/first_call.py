"""Wall time of the first MLA decoding call in a fresh process (cubins from the disk cache).

    python tools/first_call.py [--dtype bf16|fp16]

Prints the import time, the first get_mla_metadata + flash_mla_with_kvcache (module loads,
tensor maps, launch, synchronize), and a second call for comparison. Run it in a new process
after `flashmla-cupy compile` (or any earlier run) has filled the cache.
"""
from __future__ import annotations

import argparse
import time

t0 = time.perf_counter()
import cupy  # noqa: E402
import numpy as np  # noqa: E402

import flashmla_cupy  # noqa: E402
from flashmla_cupy.testing import DTYPES  # noqa: E402

t_import = time.perf_counter() - t0


def one_call(q, k_cache, block_table, seqlens):
    meta, splits = flashmla_cupy.get_mla_metadata(seqlens, q.shape[1] * q.shape[2], 1)
    out, lse = flashmla_cupy.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, splits, causal=True)
    cupy.cuda.get_current_stream().synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = ap.parse_args()
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
    one_call(q, k_cache, block_table, seqlens)
    t_first = time.perf_counter() - t1
    t2 = time.perf_counter()
    one_call(q, k_cache, block_table, seqlens)
    t_second = time.perf_counter() - t2
    print(f"import {t_import * 1e3:.0f} ms; first call (metadata + decode, {args.dtype}) "
          f"{t_first * 1e3:.0f} ms; second call {t_second * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
