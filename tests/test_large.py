"""MLA decoding at sizes where 32-bit offsets or grid limits would break (Hopper only).

* A KV cache of more than 2^32 elements (8.6 GB) with used pages right past the element offsets
  2^30, 2^31 and 2^32 and at the very end: guards every offset into the cache (byte offsets in
  int32, element offsets in int32 or uint32).
* Batch 1024 with sequences of 8192 tokens on average (a 9.7 GB cache; marked slow).
* Grid limits and large output offsets: batch 70,000 (combine grid.x beyond 65,535; out and the
  split workspace beyond 2^31 elements), batch 4096 with 512 query rows, and 576-1024 query rows
  per KV head (many 64-row blocks in the split-KV grid, 64-128 in the combine grid's y).

The big-batch tests check every request without the reference (out finite, lse = +inf exactly on
the rows that see no token) and a subset of requests against it: a request's result does not
depend on the others, so the subset is copied into inputs of its own (its pages into a small
cache, one basic-indexing copy per page) and the float64 reference runs on just those. Criteria
and tolerances are flashmla_cupy.testing's (``run_kernel``, ``check_against_reference``).

Peak GPU memory is about 35 GB (batch 70,000); every test frees what it used.
"""
from __future__ import annotations

import dataclasses
import gc
import sys

import cupy
import numpy as np
import pytest

import flashmla_cupy
from flashmla_cupy import driver, mla, scheduler
from flashmla_cupy.testing import D_K, D_V, MLACase, PAGE, check_against_reference, make_inputs, run_kernel, seed_seqlens

pytestmark = pytest.mark.hopper

DTYPE_CODE = {"bf16": 0, "fp16": 1}


def release_gpu_memory() -> None:
    """Free everything a test left: the traceback of a failure that pytest keeps for post-mortem
    debugging (its frames hold the test's arrays), the cached call plans (each keeps its first
    call's arrays and workspace alive) and the memory pool's free blocks."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    plans = getattr(mla, "_plans", None)
    if plans is not None:
        plans.clear()
    cupy.get_default_memory_pool().free_all_blocks()


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    release_gpu_memory()
    yield
    release_gpu_memory()


def fill_nan_bits(x: cupy.ndarray) -> None:
    """Set every bit of x (NaN in bfloat16 and float16) with a memset: no kernel indexes the
    (possibly > 2^32-element) array."""
    x.data.memset_async(0xFF, x.nbytes)


def sm_count() -> int:
    return driver.device_properties(cupy.cuda.runtime.getDevice())["sm_count"]


def take_requests(x: cupy.ndarray, idx) -> cupy.ndarray:
    """x[idx] along the batch axis, one basic-indexing view per request (a pointer offset computed
    on the host): no index arithmetic on the large array that 32-bit indexing could get wrong."""
    return cupy.stack([x[int(i)] for i in idx])


def compact_requests(inp: MLACase, idx) -> MLACase:
    """Requests ``idx`` of ``inp`` as inputs of their own: their pages copied one by one into a
    small cache, with a block table pointing there. The float64 reference then runs on just
    these requests and never indexes the large cache."""
    idx = np.asarray(idx)
    seqlens = inp.seqlens[idx]
    pages = -(-seqlens.astype(np.int64) // PAGE)
    table = cupy.asnumpy(inp.block_table)[idx]
    cache = cupy.empty((max(int(pages.sum()), 1), PAGE, inp.h_kv, D_K), dtype=inp.k_cache.dtype)
    fill_nan_bits(cache)
    new_table = np.zeros((len(idx), max(int(pages.max(initial=0)), 1)), dtype=np.int32)
    j = 0
    for r, count in enumerate(pages):
        for c in range(count):
            cache[j] = inp.k_cache[int(table[r, c])]
            new_table[r, c] = j
            j += 1
    return MLACase(take_requests(inp.q, idx), cache, cupy.asarray(new_table), cupy.asarray(seqlens),
                     seqlens, inp.s_q, inp.h_q, inp.h_kv)


def check_whole_batch(inp: MLACase, out, lse, causal: bool, chunk: int = 4096) -> None:
    """Every request, without the reference: out finite; lse = +inf exactly on the query rows
    that see no token (seqlen 0, or causal with seqlen < s_q), with out = 0 there; lse finite
    (no NaN, no -inf) elsewhere."""
    s_q = inp.s_q
    shift = (s_q - 1 - np.arange(s_q)) if causal and s_q > 1 else np.zeros(s_q, dtype=np.int64)
    empty = (inp.seqlens.astype(np.int64)[:, None] - shift[None, :]) <= 0     # [b, s_q]
    for lo in range(0, len(inp.seqlens), chunk):
        hi = min(lo + chunk, len(inp.seqlens))
        o = out[lo:hi].astype(np.float32)                  # [n, s_q, h_q, 512]
        l = lse[lo:hi]                                     # [n, h_q, s_q]
        e = cupy.asarray(empty[lo:hi])
        where = f"requests {lo}..{hi - 1} of {len(inp.seqlens)}"
        assert bool(cupy.isfinite(o).all()), f"non-finite out (unwritten or NaN leak) among {where}"
        assert not bool(cupy.isnan(l).any()), f"NaN lse among {where}"
        assert bool((cupy.isinf(l) == e[:, None, :]).all()), f"+inf lse rows differ from the rows that see no token among {where}"
        assert not bool((l == -np.inf).any()), f"-inf lse among {where}"
        assert not bool(((o != 0) & e[:, :, None, None]).any()), f"nonzero out on rows that see no token among {where}"


def check_subset(inp: MLACase, out, lse, idx, causal: bool, dtype: str) -> None:
    idx = sorted({int(i) for i in idx})
    sub = compact_requests(inp, idx)
    try:
        check_against_reference(sub, take_requests(out, idx), take_requests(lse, idx), causal, dtype)
    except AssertionError as e:
        raise AssertionError(f"{e} (requests {idx} of batch {len(inp.seqlens)})") from None


# --- (a) a KV cache of more than 2^32 elements -----------------------------------------------

@pytest.mark.parametrize("h_kv", [1, 2])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_kv_cache_beyond_2_32_elements(dtype, h_kv):
    """Guards the offsets into the KV cache. The cache holds 64 pages more than 2^32 elements
    (8.6 GB); the requests' pages sit at the blocks around the element offsets 2^30 (where a byte
    offset leaves int32), 2^31 (an element offset leaves int32, a byte offset uint32) and 2^32 (an
    element offset leaves uint32), at the first and last block and among the last 2048 blocks.
    Every other slot is NaN, so a wrapped offset reads NaN (or faults) instead of the page.

    The pages are built first in a small cache by make_inputs (NaN past each request's length,
    garbage block-table columns) and copied to their places; the reference runs on the small one.
    """
    rng = np.random.default_rng(100 + 10 * h_kv + DTYPE_CODE[dtype])
    block_elems = PAGE * h_kv * D_K
    num_blocks = 2**32 // block_elems + 64
    assert num_blocks * block_elems > 2**32

    seqlens = [337, 512, 1, 831, 700, 0, 129]                  # 6 + 8 + 1 + 13 + 11 + 0 + 3 = 42 pages
    s_q, h_q = 2, 32 * h_kv
    small = make_inputs(rng, seqlens, s_q, h_q, h_kv, dtype, spare_blocks=0)
    n = small.k_cache.shape[0]

    special = {0, num_blocks - 1}
    for t in (2**30, 2**31, 2**32):
        first = t // block_elems                               # the block that holds element t
        special.update(x for x in (first - 1, first, first + 1) if 0 <= x < num_blocks)
    special = np.array(sorted(special))
    assert n >= len(special)
    tail = np.setdiff1d(np.arange(num_blocks - 2048, num_blocks), special)
    big_ids = rng.permutation(np.concatenate([special, rng.choice(tail, n - len(special), replace=False)]))
    assert len(np.unique(big_ids)) == n and big_ids.max() < num_blocks

    big = cupy.empty((num_blocks, PAGE, h_kv, D_K), dtype=small.k_cache.dtype)
    fill_nan_bits(big)
    for j, block in enumerate(big_ids):
        big[int(block)] = small.k_cache[j]
    table = cupy.asnumpy(small.block_table).copy()          # host copy: small keeps its own table
    pages = -(-np.asarray(seqlens) // PAGE)
    for r, count in enumerate(pages):
        table[r, :count] = big_ids[table[r, :count]]
    # The setup itself: the pages are where the table says (bit for bit, NaN slots included) and
    # a block no request uses is NaN.
    for j in (0, n // 2, n - 1):
        assert bool((big[int(big_ids[j])].view(np.uint16) == small.k_cache[j].view(np.uint16)).all())
    used = set(big_ids.tolist())
    unused = next(x for x in range(1, num_blocks) if x not in used)
    assert bool((big[unused].view(np.uint16) == 0xFFFF).all())

    inp = dataclasses.replace(small, k_cache=big, block_table=cupy.asarray(table))
    for causal in (False, True):
        out, lse = run_kernel(inp, causal)
        try:
            check_against_reference(small, out, lse, causal, dtype)
        except AssertionError as e:
            raise AssertionError(f"{e} (cache of {num_blocks} blocks, pages at {sorted(big_ids.tolist())})") from None


# --- (b) batch 1024 with long sequences ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_batch_1024_long_sequences(dtype):
    """Guards a realistic large decode batch: 1024 requests of 8192 tokens on average (FlashMLA's
    draw: normal(8192, 4096)), one of 32k, a few of 0-65; s_q 2, 128 heads, causal. A 9.7 GB
    cache, 8.4 M tokens. Every request is checked for finiteness and its empty rows; 40 of them
    against the reference."""
    rng = np.random.default_rng(200 + DTYPE_CODE[dtype])
    b, s_q, h_q, causal = 1024, 2, 128, True
    seqlens = seed_seqlens(rng, b, 8192, s_q, varlen=True)
    seqlens[[5, 6, 7, 8]] = [0, 1, 64, 65]
    seqlens[b - 1] = 32768 + 5
    inp = make_inputs(rng, seqlens, s_q, h_q, 1, dtype)
    out, lse = run_kernel(inp, causal)
    check_whole_batch(inp, out, lse, causal)
    idx = set(rng.choice(b, 32, replace=False).tolist()) | {0, 5, 6, 7, 8, b - 1, int(np.argmax(seqlens[:-1]))}
    check_subset(inp, out, lse, idx, causal, dtype)


# --- (c) grid limits and large output offsets ------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_batch_70000_short_requests(dtype):
    """Guards the grids and output offsets of a huge batch. The combine grid is (batch, ...):
    70,000 > 65,535 blocks in x (a grid laid out with the batch in y or z would not launch). With
    s_q 4 and 16 heads (64 query rows), out holds 70,000 * 64 * 512 = 2.3e9 > 2^31 elements, and
    the split workspace's offsets pass 2^31 elements for splits numbered 65,536 and up: the test
    makes sure (host scheduler model) that some request at index >= 65,536 is split, and checks
    those against the reference. Half the requests are empty, most others one page; the last
    2000 have 300-1500 tokens, so that part boundaries fall inside them. Also compares the
    metadata kernel with the host scheduler model at this batch size."""
    rng = np.random.default_rng(300 + DTYPE_CODE[dtype])
    b, s_q, h_q, causal = 70_000, 4, 16, True
    assert b * s_q * h_q * D_V > 2**31
    seqlens = np.where(rng.random(b) < 0.5, 0, rng.integers(1, 65, b)).astype(np.int32)
    seqlens[-2000:] = rng.integers(300, 1501, 2000)
    seqlens[:4] = [0, 1, 3, 64]                                   # 1 and 3 < s_q: causal rows that see nothing

    parts = scheduler.num_sm_parts(sm_count(), s_q * h_q, 1)
    want_meta, want_splits = scheduler.schedule(seqlens, parts)
    splits_per_request = np.diff(want_splits)
    late_split = np.flatnonzero((splits_per_request > 1) & (np.arange(b) >= 65_536))
    assert late_split.size > 0, (f"test setup: no request at index >= 65536 is split over SM parts "
                                 f"({parts} parts); the test would not reach the workspace offsets it guards")
    assert int(want_splits[late_split[0]]) * s_q * h_q * D_V >= 2**31   # its split's o_accum offset

    inp = make_inputs(rng, seqlens, s_q, h_q, 1, dtype)
    metadata, num_splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
    np.testing.assert_array_equal(cupy.asnumpy(metadata), want_meta)
    np.testing.assert_array_equal(cupy.asnumpy(num_splits), want_splits)
    del metadata, num_splits

    out, lse = run_kernel(inp, causal)
    check_whole_batch(inp, out, lse, causal)
    split = np.flatnonzero(splits_per_request > 1)
    idx = (set(rng.choice(b, 24, replace=False).tolist()) | {0, 1, 2, 3, 65_535, 65_536, b - 1}
           | set(late_split[:16].tolist()) | set(split[:4].tolist()))
    check_subset(inp, out, lse, idx, causal, dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_batch_4096_with_512_query_rows(dtype):
    """Guards many query blocks per request over many requests: b 4096, s_q 4, 128 heads (512
    rows: 8 query blocks in the split-KV grid, 64 rows of warps in the combine grid, 16 SM parts
    each walking ~256 requests), short causal requests. Subset against the reference."""
    rng = np.random.default_rng(400 + DTYPE_CODE[dtype])
    b, s_q, h_q, causal = 4096, 4, 128, True
    seqlens = rng.integers(0, 400, b).astype(np.int32)
    seqlens[:4] = [0, 1, 3, 64]
    inp = make_inputs(rng, seqlens, s_q, h_q, 1, dtype)
    out, lse = run_kernel(inp, causal)
    check_whole_batch(inp, out, lse, causal)
    idx = set(rng.choice(b, 32, replace=False).tolist()) | {0, 1, 2, 3, b - 1}
    check_subset(inp, out, lse, idx, causal, dtype)


ROW_CASES = [(8, 128, 1), (8, 128, 2), (7, 100, 1)]   # q_rows 1024; 512 per kv head; 700 (a partial block)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,h_q,h_kv", ROW_CASES, ids=[f"sq{a}-hq{b}-hkv{c}" for a, b, c in ROW_CASES])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_many_query_rows(dtype, s_q, h_q, h_kv, causal):
    """Guards the query-row axis: up to 1024 rows per KV head (16 query blocks in the split-KV
    grid, so few SM parts; 128 blocks in y of the combine grid), rows that span several MTP
    tokens inside one 64-row block, and a partial last block (700 rows). Lengths from 0 through
    < s_q (causal rows that see nothing) to 20,000 (split over parts). Whole batch against the
    reference."""
    rng = np.random.default_rng([500, DTYPE_CODE[dtype], s_q, h_q, h_kv, int(causal)])
    seqlens = [0, 1, 5, 7, 8, 9, 63, 64, 65, 150, 1000, 3000, 4095, 20_000]
    inp = make_inputs(rng, seqlens, s_q, h_q, h_kv, dtype)
    out, lse = run_kernel(inp, causal)
    check_whole_batch(inp, out, lse, causal)
    check_against_reference(inp, out, lse, causal, dtype)
