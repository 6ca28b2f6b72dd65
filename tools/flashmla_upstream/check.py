"""Check the stand-in `flash_mla` (FlashMLA upstream's kernels, built by build.sh) against the
float64 reference on a few shapes, beside flashmla-cupy on the same inputs; exits 1 on a mismatch.

    PYTHONPATH=tools/flashmla_upstream python3 tools/flashmla_upstream/check.py
"""
import sys

import cupy
import numpy as np
import torch

import flash_mla
import flashmla_cupy
from flashmla_cupy import testing

SHAPES = [(16, 1000, 1, 16, "bf16"), (8, 3000, 2, 128, "bf16"), (8, 3000, 2, 64, "fp16")]   # b, mean s_k, s_q, h_q


def main() -> int:
    rng = np.random.default_rng(1)
    for b, mean, s_q, h_q, dtype in SHAPES:
        inp = testing.make_inputs(rng, testing.seed_seqlens(rng, b, mean, s_q, True), s_q, h_q, 1, dtype)
        # FlashMLA multiplies the NaN that testing puts in unused cache slots by zero weights: finite values there
        k = inp.k_cache.astype(cupy.float32)
        inp.k_cache[...] = cupy.where(cupy.isnan(k), 0.25, k).astype(inp.k_cache.dtype)
        q, k_cache, table, seqlens = (torch.from_dlpack(x) for x in (inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens))
        meta, _ = flash_mla.get_mla_metadata()
        out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, None, causal=True)
        torch.cuda.synchronize()
        try:
            testing.check_against_reference(inp, cupy.from_dlpack(out), cupy.from_dlpack(lse), True, dtype)
            ours, _ = testing.run_kernel(inp, causal=True)
        except AssertionError as e:
            print(f"FAIL {inp.describe()}: {e}")
            return 1
        diff = float(cupy.abs(ours.astype(cupy.float32) - cupy.from_dlpack(out).astype(cupy.float32)).max())
        print(f"ok   {inp.describe()}  max |flashmla-cupy - FlashMLA| = {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
