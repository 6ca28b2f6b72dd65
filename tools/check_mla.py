"""Run MLA decoding on a list of shapes and compare each with the float64 reference.

    python tools/check_mla.py [--set quick|sanitizer|bad-values] [--dtype bf16|fp16|both] [--host-reference]

One line per shape (max errors, cos_diff; the tests' criteria, flashmla_cupy.testing); exit
status 1 if any shape fails. Small enough to run under compute-sanitizer (tools/sanitize.sh uses
--set sanitizer, and --set bad-values for memcheck).

``--set bad-values``: for a few batches, every kind of bad length and block id
(``flashmla_cupy.testing.bad_values``) in one request, called with value checks "async": the
request's out and lse must be all NaN, the others must match the reference, and the error must
be raised by ``check_errors()`` naming the argument, index and value.
"""
from __future__ import annotations

import argparse
import sys
import time

import cupy
import numpy as np

import flashmla_cupy
from flashmla_cupy.testing import (apply_bad_value, bad_values, check_against_reference, check_bad_value_result,
                                   make_inputs, poisoned, run_kernel)

# (seqlens, s_q, h_q, h_kv, causal)
SHAPES = {
    "quick": [
        ([4096] * 8, 1, 128, 1, False),
        ([1, 63, 64, 65, 1000, 0, 7], 2, 16, 1, True),
        ([300, 5000, 17], 4, 32, 2, True),
        ([70000, 5, 9], 1, 64, 1, False),
    ],
    "sanitizer": [
        ([1], 1, 1, 1, False),
        ([0], 1, 16, 1, False),
        ([63], 1, 16, 1, False),
        ([64], 1, 16, 1, False),
        ([65], 2, 16, 1, True),
        ([1000, 1], 1, 128, 1, False),
        ([0, 5, 0], 2, 128, 1, True),
        ([1, 2], 4, 16, 1, True),
        ([129, 3000, 64, 65, 1, 0, 900], 1, 16, 2, False),
        ([129, 3000, 64, 65, 1, 0, 900], 2, 32, 2, True),
        ([5000] * 3, 1, 2, 2, False),
        ([200] * 16, 2, 64, 1, True),
        ([4096] * 4, 1, 128, 1, False),
        ([4096] * 4, 2, 128, 1, True),
        ([8192, 100], 1, 16, 1, False),
        ([20000], 1, 128, 1, False),
        ([20000], 2, 64, 1, True),
        ([7, 700, 7000], 4, 16, 1, True),
        ([1, 1, 1, 1, 1, 1, 1, 1], 1, 128, 1, False),
        ([2048] * 33, 1, 16, 1, False),
        ([3, 65, 129], 3, 5, 1, True),
        ([1000] * 5, 1, 128, 2, False),
    ],
}


# (seqlens, s_q, h_q, h_kv, causal, request given the bad values)
BAD_VALUE_BATCHES = [
    ([100, 200, 300, 64], 1, 16, 1, False, 1),
    ([1000, 5, 2000], 2, 128, 1, True, 2),
    ([70000, 10, 10], 1, 128, 1, False, 0),     # the request is split over many SM parts: combine
]


def check_bad_values(seqlens, s_q, h_q, h_kv, causal, request, dtype, rng, host_reference: bool):
    """One (ok, label, message) per bad value of ``request``."""
    results = []
    base = make_inputs(rng, seqlens, s_q, h_q, h_kv, dtype)
    meta, splits = flashmla_cupy.get_mla_metadata(base.cache_seqlens, s_q * h_q // h_kv, h_kv)
    good_lengths, good_table = base.cache_seqlens.copy(), base.block_table.copy()
    for bad in bad_values(base, request, causal):
        base.cache_seqlens[...] = good_lengths
        base.block_table[...] = good_table
        apply_bad_value(base, bad)
        b = len(seqlens)
        out, lse = poisoned((b, s_q, h_q, 512), base.q.dtype), poisoned((b, h_q, s_q), np.float32)
        with flashmla_cupy.value_checks("async"):
            flashmla_cupy.flash_mla_with_kvcache(base.q, base.k_cache, base.block_table, base.cache_seqlens, 512,
                                                 meta, splits, causal=causal, out=out, lse=lse)
            try:
                flashmla_cupy.check_errors()
                raised = None
            except ValueError as e:
                raised = str(e)
        label = f"{dtype} b={b} s_q={s_q} h_q={h_q} causal={int(causal)} {bad.describe()}"
        try:
            assert raised is not None, "no error raised"
            assert raised.startswith(bad.message) and str(bad.value) in raised, f"wrong error: {raised}"
            case = base.to_host() if host_reference else base
            got = (cupy.asnumpy(out), cupy.asnumpy(lse)) if host_reference else (out, lse)
            check_bad_value_result(case, bad, *got, causal, dtype)
        except AssertionError as e:
            results.append((False, label, str(e)))
            continue
        results.append((True, label, "NaN rows, others match, error raised"))
    return results


def check(seqlens, s_q, h_q, h_kv, causal, dtype, rng, host_reference: bool) -> tuple[bool, str]:
    inp = make_inputs(rng, seqlens, s_q, h_q, h_kv, dtype)
    out, lse = run_kernel(inp, causal)
    if host_reference:
        inp, out, lse = inp.to_host(), cupy.asnumpy(out), cupy.asnumpy(lse)
    try:
        err = check_against_reference(inp, out, lse, causal, dtype)
    except AssertionError as e:
        return False, str(e)
    return True, (f"max|out err| {err['max_abs_out']:.2e}  max|lse err| {err['max_abs_lse']:.2e}  "
                  f"cos_diff {err['cos_diff_out']:.1e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=sorted([*SHAPES, "bad-values"]), default="quick")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "both"], default="both")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--range", default=":", help="START:STOP, a slice of the set's shapes (e.g. 0:11)")
    ap.add_argument("--host-reference", action="store_true",
                    help="compute the reference and the comparison with NumPy (fewer GPU kernels: "
                         "much faster under compute-sanitizer)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else int(time.time())
    rng = np.random.default_rng(seed)
    print(f"seed {seed}, device {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    failures = 0
    for dtype in (["bf16", "fp16"] if args.dtype == "both" else [args.dtype]):
        start, stop = (int(x) if x else None for x in args.range.split(":"))
        if args.set == "bad-values":
            for batch in BAD_VALUE_BATCHES[start:stop]:
                for ok, label, msg in check_bad_values(*batch, dtype, rng, args.host_reference):
                    failures += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} {label:<70} {msg}", flush=True)
            continue
        for seqlens, s_q, h_q, h_kv, causal in SHAPES[args.set][start:stop]:
            ok, msg = check(seqlens, s_q, h_q, h_kv, causal, dtype, rng, args.host_reference)
            failures += not ok
            label = f"{dtype} b={len(seqlens)} s_k<={max(seqlens)} s_q={s_q} h_q={h_q} h_kv={h_kv} causal={int(causal)}"
            print(f"{'ok  ' if ok else 'FAIL'} {label:<58} {msg}", flush=True)
    print(f"{failures} failing shape(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
