"""GPU tests of dense decoding over the FP8 cache (is_fp8_kvcache=True, k_scale), skipped without
a Hopper GPU.

The cases are ``testing.make_inputs(..., "fp8")``: bf16 q, e4m3 codes with a per-tensor scale
(not a power of two), NaN codes in every slot no request may read, permuted block tables; and
``"fp8q"``: the same cache with an e4m3 q and its own scale (q_scale). The reference is the
float64 one on the dequantized inputs (codes times their scale, exact), with
``check_against_reference``'s criteria: cos_diff < 1e-5 on out and lse, and per element
|err| <= 1e-2 + 1e-2 |ref| for out (bf16 output rounding dominates: Q, K and V are exact in the
kernel's fp16, P is fp16), lse within 1e-3 + 1e-5 |ref|. An e4m3 q (both products in FP8, P
rounded to e4m3): out within that bound plus 2^-4 sum p|v| / sum p, cos_diff < 2^-8 on out,
lse within 1e-2 (element bound only; testing.py says why). Also with the FP8 cache: bad lengths
and block ids (test_values.py), empty requests, softmax_scale and determinism (test_mla.py).
"""
from __future__ import annotations

import itertools

import cupy
import numpy as np
import pytest

import flashmla_cupy
from flashmla_cupy import quant
from flashmla_cupy.testing import check_against_reference, make_inputs, poisoned, run_kernel, seed_seqlens

pytestmark = pytest.mark.hopper

# --- FlashMLA's test grid (b = 128, causal), at page 64 and at other page sizes ------------------

SEED_GRID = list(itertools.product([4096, 8192, 16384], [16, 32, 64, 128], [1, 2], [False, True]))


@pytest.mark.parametrize("mean_sk,h_q,s_q,varlen", SEED_GRID,
                         ids=[f"sk{a}-hq{b}-sq{c}-{'var' if d else 'fix'}" for a, b, c, d in SEED_GRID])
def test_seed_grid(mean_sk, h_q, s_q, varlen):
    rng = np.random.default_rng()
    inp = make_inputs(rng, seed_seqlens(rng, 128, mean_sk, s_q, varlen), s_q, h_q, 1, "fp8")
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, "fp8")


# An e4m3 q: a corner of each class of the grid (its own staging and expansion of Q, per request).
E4M3_Q_GRID = list(itertools.product([4096, 16384], [16, 128], [1, 2]))


@pytest.mark.parametrize("mean_sk,h_q,s_q", E4M3_Q_GRID, ids=[f"sk{a}-hq{b}-sq{c}-var" for a, b, c in E4M3_Q_GRID])
def test_seed_grid_with_e4m3_q(mean_sk, h_q, s_q):
    rng = np.random.default_rng()
    inp = make_inputs(rng, seed_seqlens(rng, 128, mean_sk, s_q, True), s_q, h_q, 1, "fp8q")
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, "fp8q")


# h_q 16: the narrow kernel; 64 with s_q 1: one m-block (the split-KV kernel's loads-bound refills); 128: two.
PAGE_GRID = list(itertools.product([1, 2, 16, 32, 128, 256], [16, 64, 128], [1, 2]))


@pytest.mark.parametrize("page,h_q,s_q", PAGE_GRID, ids=[f"page{a}-hq{b}-sq{c}" for a, b, c in PAGE_GRID])
def test_seed_grid_at_page_size(page, h_q, s_q):
    rng = np.random.default_rng()
    inp = make_inputs(rng, seed_seqlens(rng, 64, 4096, s_q, True), s_q, h_q, 1, "fp8", page_size=page)
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, "fp8")


ONE_TOKEN_GRID = list(itertools.product(["fp8", "fp8q"], [(32, 1), (64, 1), (128, 2)]))


@pytest.mark.parametrize("dtype,heads", ONE_TOKEN_GRID, ids=[f"{a}-hq{b[0]}-sq{b[1]}" for a, b in ONE_TOKEN_GRID])
def test_one_token_pages_over_long_requests(dtype, heads):
    """One-token pages, each request's tokens scattered over the cache: the split-KV kernel's forms
    that copy tokens (a bf16 q's expander, an e4m3 q's consumers) across many page pairs and
    requests, with the narrow kernel's (h_q 32, bf16 q) beside them."""
    rng = np.random.default_rng()
    h_q, s_q = heads
    inp = make_inputs(rng, seed_seqlens(rng, 32, 8192, s_q, True), s_q, h_q, 1, dtype, page_size=1)
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, dtype)


# --- small and odd shapes: one m-block, pairs of m-blocks (clusters), an odd count ---------------

SMALL = list(itertools.product([1, 7], [1, 63, 64, 65, 1000], [(1, 1), (16, 2), (64, 3), (128, 1), (32, 8)]))


@pytest.mark.parametrize("dtype", ["fp8", "fp8q"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,seqlen,heads", SMALL, ids=[f"b{a}-sk{b}-hq{c[0]}-sq{c[1]}" for a, b, c in SMALL])
def test_small_shapes(b, seqlen, heads, causal, dtype):
    rng = np.random.default_rng()
    h_q, s_q = heads
    seqlens = np.maximum(seqlen - rng.integers(0, 3, b) * (seqlen // 3), 1)
    if b > 2:
        seqlens[rng.integers(b)] = 0
    page = int(rng.choice([1, 16, 64, 256]))
    inp = make_inputs(rng, seqlens, s_q, h_q, 1, dtype, page_size=page)
    out, lse = run_kernel(inp, causal)
    check_against_reference(inp, out, lse, causal, dtype)


@pytest.mark.parametrize("h_q,s_q", [(16, 2), (128, 2)])
def test_e4m3_q_strided_across_heads(h_q, s_q):
    """An e4m3 q whose heads are not evenly strided rows (a [b, h_q, s_q, 576] buffer
    transposed): the call copies it into the workspace as bytes, then stages it as in place."""
    rng = np.random.default_rng()
    inp = make_inputs(rng, rng.integers(1, 3000, 9), s_q, h_q, 1, "fp8q", page_size=16)
    inp.q = cupy.ascontiguousarray(inp.q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not inp.q.flags.c_contiguous
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, "fp8q")


@pytest.mark.parametrize("h_q,s_q", [(16, 1), (128, 2)])
def test_long_and_skewed_batch(h_q, s_q):
    """One very long request among short ones: it is split over many SM parts (combine path)."""
    rng = np.random.default_rng()
    seqlens = rng.integers(1, 200, 16)
    seqlens[3] = 70000
    inp = make_inputs(rng, seqlens, s_q, h_q, 1, "fp8")
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, "fp8")


@pytest.mark.parametrize("dtype,h_q,s_q", [("fp8q", 16, 1), ("fp8q", 128, 2), ("fp8", 64, 2)])
def test_running_max_jumps_between_pages(dtype, h_q, s_q):
    """test_mla's case on the FP8 cache: the RoPE codes of each cache block rescaled by 0.05 to 12
    (clipped to e4m3's range; NaN codes stay NaN), in permuted block order, so that each row's
    running max jumps at random pages of both warpgroups. With an e4m3 q the max moves in whole
    numbers and warpgroup 0 rescales its e4m3 P0 (splitkv_softmax.cuh)."""
    rng = np.random.default_rng()
    inp = make_inputs(rng, seed_seqlens(rng, 12, 1500, s_q, True), s_q, h_q, 1, dtype)
    factors = cupy.asarray(rng.choice([0.05, 0.5, 1.0, 4.0, 12.0], size=inp.k_cache.shape[0]), dtype=cupy.float32)
    codes = inp.k_cache[..., 512:]
    rope = quant.dequantize_fp8_per_tensor(codes, 1.0) * factors[:, None, None, None]
    readable = cupy.isfinite(rope)
    rescaled = quant.quantize_fp8_per_tensor(cupy.where(readable, rope, 0), scale=1.0)[0]
    inp.k_cache[..., 512:] = cupy.where(readable, rescaled, codes)
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, dtype)


# --- the scales are read by the kernel: new values in place, eager and in a CUDA graph ------------

@pytest.mark.parametrize("dtype", ["fp8", "fp8q"])
def test_scales_are_read_on_the_device_by_eager_calls_and_graph_replays(dtype):
    rng = np.random.default_rng()
    inp = make_inputs(rng, rng.integers(1, 5000, 9), 2, 64, 1, dtype)
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 2 * 64, 1)
    out, lse = poisoned((9, 2, 64, 512), inp.out_dtype), poisoned((9, 64, 2), np.float32)
    ws = flashmla_cupy.get_mla_workspace(inp.q, inp.k_cache, meta)
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())

    def call():
        return flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512,
                                                    meta, splits, causal=True, out=out, lse=lse, workspace=ws,
                                                    stream=stream, **inp.cache_kwargs())

    def rescale(k_scale, q_scale):
        with stream:
            inp.k_scale.fill(np.float32(k_scale))
            if inp.q_scale is not None:
                inp.q_scale.fill(np.float32(q_scale))

    call()
    stream.synchronize()
    check_against_reference(inp, out, lse, True, dtype)
    rescale(0.011, 0.04)                                       # eager: the next call reads them
    call()
    stream.synchronize()
    check_against_reference(inp, out, lse, True, dtype)

    with stream:                                               # the plan of this stream is warm
        stream.begin_capture()
        call()
        graph = stream.end_capture()
    rescale(0.05, 0.003)                                       # a replay reads the new values
    with stream:
        out.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    check_against_reference(inp, out, lse, True, dtype)
