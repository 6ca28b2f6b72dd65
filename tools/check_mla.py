"""Run MLA decoding on a list of shapes and compare each with the float64 reference.

    python tools/check_mla.py [--set quick|sanitizer|bad-values] [--dtype bf16|fp16|fp8|fp8q|both] [--host-reference]

One line per shape (max errors, cos_diff; the tests' criteria, flashmla_cupy.testing); exit
status 1 if any shape fails. Small enough to run under compute-sanitizer (tools/sanitize.sh uses
--set sanitizer, and --set bad-values for memcheck).

``--set bad-values`` (value checks "async"; --range slices its 10 items): for eight batches (four
with pages of 1, 16 and 256 tokens), every kind of bad length and block id
(``flashmla_cupy.testing.bad_values``) in one request: the
request's out and lse must be all NaN (they start finite), the others must match the reference,
and ``check_errors()`` must raise the error naming the argument, index and value; a negative
length into get_mla_metadata (reported there, then NaN rows and reported by the call); metadata
of another batch (garbage num_splits and part ranges): reported where the kernels can tell, and
a correct call afterwards is right. Under compute-sanitizer memcheck this shows that no bad
value makes a kernel touch memory outside its arrays.

``--dtype fp8``: the dense FP8 cache (bf16 q; ``testing.make_inputs(..., "fp8")``), ``fp8q``: that
cache with an e4m3 q; shapes and batches with several KV heads are skipped (that cache has one). ``both`` is bf16 and fp16.
"""
from __future__ import annotations

import argparse
import re
import sys
import time

import cupy
import numpy as np

import flashmla_cupy
from flashmla_cupy.testing import (FOREIGN_METADATA, FP8_CASES, PAGE, SCHEDULE_ERROR, BadValue, apply_bad_value,
                                   bad_values, check_against_reference, check_bad_value_result, finite_outputs,
                                   make_inputs, run_kernel)

# (seqlens, s_q, h_q, h_kv, causal[, page block size, default 64])
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
        ([1, 63, 65, 1000], 2, 16, 1, True, 1),
        ([300, 5000, 17, 0], 1, 128, 1, False, 16),
        ([4096] * 2, 1, 128, 1, False, 32),
        ([129, 3000, 0, 900], 2, 32, 2, True, 256),
        ([1000, 1, 3000, 130], 2, 128, 1, True, 1),
        ([300, 5000, 17, 0], 1, 16, 1, True, 16),
    ],
}


# (seqlens, s_q, h_q, h_kv, causal, request given the bad values[, page block size])
BAD_VALUE_BATCHES = [
    ([100, 200, 300, 64, 0, 1000], 1, 16, 1, False, 2),
    ([1000, 5, 2000, 64, 130, 1], 2, 128, 1, True, 2),     # the request is split: combine
    ([129, 3000, 64, 65, 1, 900], 2, 32, 2, False, 5),     # two KV heads
    ([70000, 10, 10], 1, 128, 1, False, 0),                # split over many SM parts
    ([100, 64, 1, 3, 0, 700], 1, 16, 1, False, 5, 1),      # pages of one token
    ([900, 5, 3000, 257, 130, 1], 2, 128, 1, True, 2, 256),
    ([1000, 5, 2000, 64, 130, 1], 2, 128, 1, True, 2, 1),   # one-token pages, two m-blocks (split-KV)
    ([100, 200, 17, 64, 0, 1000], 1, 16, 1, False, 2, 16),  # 16-token pages (FP8, bf16 q: the narrow kernel)
]
# Scheduler metadata of another batch (flashmla_cupy.testing.FOREIGN_METADATA): request 0 of
# this batch is split and SM part 0 starts it, so the reported kinds always are.
FOREIGN_BATCH = ([3000, 100, 5000, 1, 0, 700], 1, 16, 1, False)


def raised_by(fn) -> str | None:
    """The message of the ValueError that ``fn()`` raises, or None."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def call(inp, meta, splits, causal, out, lse):
    flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512,
                                         meta, splits, causal=causal, out=out, lse=lse, **inp.cache_kwargs())


def check_result(inp, bad, out, lse, causal, dtype, host_reference: bool) -> None:
    if host_reference:
        inp, out, lse = inp.to_host(), cupy.asnumpy(out), cupy.asnumpy(lse)
    check_bad_value_result(inp, bad, out, lse, causal, dtype)


def check_error(raised: str | None, start: str, value: int) -> None:
    assert raised is not None, "no error raised"
    assert raised.startswith(start) and re.search(rf"; got {value}(?!\d)", raised), f"wrong error: {raised}"


def check_bad_values(seqlens, s_q, h_q, h_kv, causal, request, dtype, rng, host_reference: bool, page_size=PAGE):
    """One (ok, label, message) per bad value of ``request``, as each is checked."""
    if dtype in FP8_CASES and h_kv > 1:
        return                                      # the FP8 cache has one KV head
    base = make_inputs(rng, seqlens, s_q, h_q, h_kv, dtype, page_size=page_size)
    meta, splits = flashmla_cupy.get_mla_metadata(base.cache_seqlens, s_q * h_q // h_kv, h_kv)
    good_lengths, good_table = base.cache_seqlens.copy(), base.block_table.copy()
    for bad in bad_values(base, request, causal):
        base.cache_seqlens[...] = good_lengths
        base.block_table[...] = good_table
        apply_bad_value(base, bad)
        out, lse = finite_outputs(base)
        with flashmla_cupy.value_checks("async"):
            call(base, meta, splits, causal, out, lse)
            raised = raised_by(flashmla_cupy.check_errors)
        label = (f"{dtype} b={len(seqlens)} s_q={s_q} h_q={h_q} h_kv={h_kv} causal={int(causal)} "
                 f"page={page_size} {bad.describe()}")
        try:
            check_error(raised, bad.message, bad.value)
            check_result(base, bad, out, lse, causal, dtype, host_reference)
        except AssertionError as e:
            yield False, label, str(e)
            continue
        yield True, label, "NaN rows, others match, error raised"


def check_negative_length(dtype, rng, host_reference: bool):
    """A negative length into get_mla_metadata (reported, scheduled as 0), then into the call
    (NaN rows for the request, reported again)."""
    seqlens, s_q, h_q, causal = [300, 100, 5000, 64, 0, 2], 2, 16, True
    inp = make_inputs(rng, seqlens, s_q, h_q, 1, dtype)
    bad = BadValue("cache_seqlens", 1, -5)
    apply_bad_value(inp, bad)
    out, lse = finite_outputs(inp)
    with flashmla_cupy.value_checks("async"):
        meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
        from_metadata = raised_by(flashmla_cupy.check_errors)
        call(inp, meta, splits, causal, out, lse)
        from_call = raised_by(flashmla_cupy.check_errors)
    label = f"{dtype} get_mla_metadata and the call with {bad.describe()}"
    try:
        check_error(from_metadata, "cache_seqlens[1] must be >= 0", -5)
        check_error(from_call, bad.message, -5)
        check_result(inp, bad, out, lse, causal, dtype, host_reference)
    except AssertionError as e:
        return [(False, label, str(e))]
    return [(True, label, "reported twice, NaN rows, others match")]


def check_foreign_metadata(dtype, rng, host_reference: bool):
    """Metadata of another batch: the kernels stay inside their arrays and report what they can;
    a correct call afterwards is right. One (ok, label, message) per edit, as each is checked."""
    seqlens, s_q, h_q, h_kv, causal = FOREIGN_BATCH
    inp = make_inputs(rng, seqlens, s_q, h_q, h_kv, dtype)
    for name, edit, reported in FOREIGN_METADATA:
        label = f"{dtype} b={len(seqlens)} s_q={s_q} h_q={h_q} metadata of another batch: {name}"
        with flashmla_cupy.value_checks("async"):
            meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, s_q * h_q // h_kv, h_kv)
            edit(meta, splits, rng)
            call(inp, meta, splits, causal, *finite_outputs(inp))
            raised = raised_by(flashmla_cupy.check_errors)
            out, lse = run_kernel(inp, causal)
            after = raised_by(flashmla_cupy.check_errors)
        try:
            assert raised is not None or not reported, "no error raised"
            assert raised is None or raised.startswith(SCHEDULE_ERROR), f"wrong error: {raised}"
            assert after is None, f"error from a correct call: {after}"
            case, got = (inp.to_host(), (cupy.asnumpy(out), cupy.asnumpy(lse))) if host_reference else (inp, (out, lse))
            check_against_reference(case, *got, causal, dtype)
        except AssertionError as e:
            yield False, label, str(e)
            continue
        yield True, label, ("reported" if raised else "not reported") + "; the next correct call is right"


# --set bad-values: (what, function(dtype, rng, host_reference) -> (ok, label, message) per case, as each ends)
BAD_VALUE_SET = [
    *((f"bad values b={len(b[0])}", lambda dtype, rng, host, b=b: check_bad_values(*b[:6], dtype, rng, host, *b[6:]))
      for b in BAD_VALUE_BATCHES),
    ("negative length into get_mla_metadata", check_negative_length),
    ("metadata of another batch", check_foreign_metadata),
]


def check(seqlens, s_q, h_q, h_kv, causal, dtype, rng, host_reference: bool, page_size=PAGE) -> tuple[bool, str]:
    inp = make_inputs(rng, seqlens, s_q, h_q, h_kv, dtype, page_size=page_size)
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
    ap.add_argument("--dtype", choices=["bf16", "fp16", *FP8_CASES, "both"], default="both")
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
            for _, check_items in BAD_VALUE_SET[start:stop]:
                begin = time.perf_counter()
                for ok, label, msg in check_items(dtype, rng, args.host_reference):   # as each case ends
                    failures += not ok
                    now = time.perf_counter()
                    print(f"{'ok  ' if ok else 'FAIL'} {label:<70} {msg} ({now - begin:.1f} s)", flush=True)
                    begin = now
            continue
        for seqlens, s_q, h_q, h_kv, causal, *page in SHAPES[args.set][start:stop]:
            if dtype in FP8_CASES and h_kv > 1:
                continue                            # the FP8 cache has one KV head
            page_size = page[0] if page else PAGE
            ok, msg = check(seqlens, s_q, h_q, h_kv, causal, dtype, rng, args.host_reference, page_size)
            failures += not ok
            label = (f"{dtype} b={len(seqlens)} s_k<={max(seqlens)} s_q={s_q} h_q={h_q} h_kv={h_kv} "
                     f"causal={int(causal)} page={page_size}")
            print(f"{'ok  ' if ok else 'FAIL'} {label:<58} {msg}", flush=True)
    print(f"{failures} failing shape(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
