"""GPU tests of MLA decoding against the float64 reference (skipped without a Hopper GPU).

Criteria (flashmla_cupy.testing.check_against_reference): FlashMLA's cos_diff < 1e-5 on out and
lse, plus per-element bounds: every element finite where the reference is (outputs start as
NaN), |err| <= atol + rtol*|ref| (input-precision rounding of P and of O dominates), and +inf
lse exactly where the reference has it.
"""
from __future__ import annotations

import itertools

import cupy
import numpy as np
import pytest

import flashmla_cupy
from flashmla_cupy import scheduler
from flashmla_cupy.testing import check_against_reference, make_inputs, poisoned, run_kernel, seed_seqlens

pytestmark = pytest.mark.hopper

# --- FlashMLA's own test grid: b = 128, causal, h_kv = 1 ------------------------------------

SEED_GRID = list(itertools.product([4096, 8192, 16384], [16, 32, 64, 128], [1, 2], [False, True], ["bf16", "fp16"]))


@pytest.mark.parametrize("mean_sk,h_q,s_q,varlen,dtype", SEED_GRID,
                         ids=[f"sk{a}-hq{b}-sq{c}-{'var' if d else 'fix'}-{e}" for a, b, c, d, e in SEED_GRID])
def test_seed_grid(mean_sk, h_q, s_q, varlen, dtype):
    rng = np.random.default_rng()
    inp = make_inputs(rng, seed_seqlens(rng, 128, mean_sk, s_q, varlen), s_q, h_q, 1, dtype)
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, dtype)


# --- cache pages of other sizes: whole pages per kernel page (64 tokens), or slices of one ------

PAGE_SIZES = [1, 2, 16, 32, 128, 256]
PAGE_GRID = list(itertools.product(PAGE_SIZES, [4096, 16384], [16, 128], [1, 2], ["bf16", "fp16"]))


@pytest.mark.parametrize("page,mean_sk,h_q,s_q,dtype", PAGE_GRID,
                         ids=[f"page{a}-sk{b}-hq{c}-sq{d}-{e}" for a, b, c, d, e in PAGE_GRID])
def test_seed_grid_at_page_size(page, mean_sk, h_q, s_q, dtype):
    rng = np.random.default_rng()
    inp = make_inputs(rng, seed_seqlens(rng, 128, mean_sk, s_q, True), s_q, h_q, 1, dtype, page_size=page)
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, dtype)


SMALL_PAGED = list(itertools.product([1, 2, 8, 32, 128, 256], [1, 63, 65, 1000], [(16, 1, 2), (128, 1, 1), (16, 2, 4)]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page,seqlen,heads", SMALL_PAGED, ids=[f"page{a}-sk{b}-hq{c[0]}-hkv{c[1]}-sq{c[2]}"
                                                                for a, b, c in SMALL_PAGED])
def test_small_shapes_at_page_size(page, seqlen, heads, causal):
    rng = np.random.default_rng()
    h_q, h_kv, s_q = heads
    seqlens = np.maximum(seqlen - rng.integers(0, 3, 3) * (seqlen // 3), 1)
    seqlens[rng.integers(3)] = 0
    inp = make_inputs(rng, seqlens, s_q, h_q, h_kv, "bf16", page_size=page)
    out, lse = run_kernel(inp, causal)
    check_against_reference(inp, out, lse, causal, "bf16")


# --- small and odd shapes ----------------------------------------------------------------------

def _small_cases():
    cases = []
    for b, seqlen in itertools.product([1, 2, 7], [1, 63, 64, 65, 1000]):
        for (h_q, h_kv), s_q in itertools.product([(1, 1), (16, 1), (128, 1), (16, 2), (2, 2)], [1, 2, 4]):
            cases.append((b, seqlen, h_q, h_kv, s_q))
    return cases


SMALL = _small_cases()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,seqlen,h_q,h_kv,s_q", SMALL, ids=[f"b{a}-sk{b}-hq{c}-hkv{d}-sq{e}" for a, b, c, d, e in SMALL])
def test_small_shapes(b, seqlen, h_q, h_kv, s_q, causal, dtype):
    rng = np.random.default_rng()
    # Vary lengths around the nominal one, including 0 where the batch allows.
    seqlens = np.maximum(seqlen - rng.integers(0, 3, b) * (seqlen // 3), 1)
    if b > 2:
        seqlens[rng.integers(b)] = 0
    inp = make_inputs(rng, seqlens, s_q, h_q, h_kv, dtype)
    out, lse = run_kernel(inp, causal)
    check_against_reference(inp, out, lse, causal, dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8"])
def test_empty_requests_and_short_causal(dtype):
    """seqlen 0 gives out = 0, lse = +inf; causal rows that see nothing likewise."""
    rng = np.random.default_rng()
    inp = make_inputs(rng, [0, 1, 0, 2, 130, 0], 4, 16, 1, dtype)
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, dtype)
    assert bool((out[0] == 0).all()) and bool(cupy.isinf(lse[0]).all())


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_softmax_scale_and_deterministic(dtype):
    rng = np.random.default_rng()
    inp = make_inputs(rng, rng.integers(1, 3000, 37), 2, 64, 1, dtype)
    first = run_kernel(inp, causal=True, softmax_scale=0.1)
    check_against_reference(inp, *first, True, dtype, softmax_scale=0.1)
    for _ in range(3):
        again = run_kernel(inp, causal=True, softmax_scale=0.1)
        assert bool((again[0].view(np.uint16) == first[0].view(np.uint16)).all())
        assert bool((again[1].view(np.uint32) == first[1].view(np.uint32)).all())


def test_long_and_skewed_batch():
    """One very long request among short ones: it is split over many SM parts (combine path)."""
    rng = np.random.default_rng()
    seqlens = rng.integers(1, 200, 16)
    seqlens[3] = 70000
    inp = make_inputs(rng, seqlens, 1, 128, 1, "bf16")
    out, lse = run_kernel(inp, causal=False)
    check_against_reference(inp, out, lse, False, "bf16")


# --- the scheduler kernel ----------------------------------------------------------------------

@pytest.mark.parametrize("trial", range(20))
def test_scheduler_kernel_matches_model(trial):
    rng = np.random.default_rng()
    batch = int(rng.integers(1, 400))
    seqlens = rng.integers(0, 20000, batch).astype(np.int32)
    if trial % 4 == 0:
        seqlens[:] = rng.integers(0, 3)
    h_q, s_q, h_kv = [(16, 1, 1), (128, 2, 1), (64, 1, 2), (1, 1, 1)][trial % 4]
    metadata, num_splits = flashmla_cupy.get_mla_metadata(cupy.asarray(seqlens), s_q * h_q // h_kv, h_kv)
    sm_count = cupy.cuda.Device().attributes["MultiProcessorCount"]
    parts = scheduler.num_sm_parts(sm_count, s_q * h_q // h_kv, h_kv)
    want_meta, want_splits = scheduler.schedule(seqlens, parts)
    np.testing.assert_array_equal(cupy.asnumpy(metadata), want_meta)
    np.testing.assert_array_equal(cupy.asnumpy(num_splits), want_splits)


@pytest.mark.parametrize("trial", range(8))
def test_scheduler_kernel_matches_model_with_topk(trial):
    """Sparse decoding's metadata: every query token is a request of topk tokens whatever
    cache_seqlens holds (even negative lengths: only its length is read), topk in slot 5."""
    rng = np.random.default_rng()
    batch = int(rng.integers(1, 200))
    seqlens = rng.integers(-2**31, 2**31, batch, dtype=np.int64).astype(np.int32)
    s_q, h_q = [(1, 128), (2, 64), (1, 16), (4, 128)][trial % 4]
    topk = int(rng.choice([1, 64, 128, 2048, 8192, int(rng.integers(1, 20000))]))
    metadata, num_splits = flashmla_cupy.get_mla_metadata(cupy.asarray(seqlens), s_q * h_q, 1, h_q, True, topk)
    parts = scheduler.num_sm_parts(cupy.cuda.Device().attributes["MultiProcessorCount"], h_q, 1)
    want_meta, want_splits = scheduler.schedule(np.zeros(batch * s_q, np.int32), parts, topk=topk)
    assert (want_meta[:, 5] == topk).all()
    np.testing.assert_array_equal(cupy.asnumpy(metadata), want_meta)
    np.testing.assert_array_equal(cupy.asnumpy(num_splits), want_splits)
    flashmla_cupy.check_errors()                              # the lengths were not read



# --- allocation-free calls and CUDA graphs ----------------------------------------------------

@pytest.mark.parametrize("h_kv", [1, 2])
def test_cuda_graph_capture_replays_like_eager_calls(h_kv):
    rng = np.random.default_rng()
    inp = make_inputs(rng, rng.integers(1, 5000, 9), 2, 64, h_kv, "bf16")
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 2 * 64 // h_kv, h_kv)
    out = poisoned((9, 2, 64, 512), inp.q.dtype)
    lse = poisoned((9, 64, 2), np.float32)
    ws = flashmla_cupy.get_mla_workspace(inp.q, inp.k_cache, meta)
    stream = cupy.cuda.Stream(non_blocking=True)
    # The inputs were written on the default stream; `stream` does not wait for it by itself
    # (nothing in the call synchronizes: without this, the kernels may read them unwritten).
    stream.wait_event(cupy.cuda.get_current_stream().record())

    def call(**outputs):
        return flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512,
                                                    meta, splits, causal=True, **outputs)

    with stream:
        call(out=out, lse=lse, workspace=ws)              # warm: modules loaded, plan built
        out[...] = np.nan
        stream.begin_capture()
        call(out=out, lse=lse, workspace=ws)
        graph = stream.end_capture()
        for trial in range(2):
            inp.q[...] = cupy.random.standard_normal(inp.q.shape, dtype=np.float32).astype(inp.q.dtype)
            graph.launch(stream)
            want_out, want_lse = call()
            stream.synchronize()
            assert bool((out.view(np.uint16) == want_out.view(np.uint16)).all()), f"replay {trial}: out differs"
            assert bool((lse.view(np.uint32) == want_lse.view(np.uint32)).all()), f"replay {trial}: lse differs"
    check_against_reference(inp, out, lse, True, "bf16")


def test_workspace_from_another_shape_is_rejected():
    rng = np.random.default_rng()
    inp = make_inputs(rng, [100, 200], 1, 16, 1, "bf16")
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 16, 1)
    other = make_inputs(rng, [100, 200, 300], 1, 16, 1, "bf16")
    ws = flashmla_cupy.get_mla_workspace(other.q, other.k_cache, meta)
    with pytest.raises(ValueError, match="workspace"):
        flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512,
                                             meta, splits, workspace=ws)


@pytest.mark.parametrize("softmax_scale", [1e-4, 1e-6, 50.0])
def test_extreme_softmax_scales_keep_masked_tokens_out(softmax_scale):
    """Masked scores must give exactly zero weight whatever the scale (rows seeing nothing: +inf lse)."""
    rng = np.random.default_rng()
    inp = make_inputs(rng, [1, 3, 70, 0], 4, 16, 1, "bf16")
    out, lse = run_kernel(inp, causal=True, softmax_scale=softmax_scale)
    check_against_reference(inp, out, lse, True, "bf16", softmax_scale=softmax_scale)


@pytest.mark.parametrize("s_q,h_q,dtype", [(1, 16, "bf16"), (2, 64, "fp16"), (1, 128, "bf16"), (2, 128, "fp16")])
def test_running_max_jumps_between_pages(s_q, h_q, dtype):
    """The rope part of each cache block (columns 512-575, which enter the scores but not V) scaled
    by factors from 0.05 to 12, in permuted block order: each row's running max jumps past the
    lazy threshold (splitkv_softmax.cuh) at random pages of both warpgroups, up and down, so
    rescales by factors other than 1 run mid-sequence next to pages whose weights are tiny."""
    rng = np.random.default_rng()
    inp = make_inputs(rng, seed_seqlens(rng, 12, 1500, s_q, True), s_q, h_q, 1, dtype)
    factors = cupy.asarray(rng.choice([0.05, 0.5, 1.0, 4.0, 12.0], size=inp.k_cache.shape[0]), dtype=cupy.float32)
    rope = inp.k_cache[..., 512:].astype(cupy.float32) * factors[:, None, None, None]
    inp.k_cache[..., 512:] = rope.astype(inp.k_cache.dtype)             # NaN slots stay NaN
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, dtype)
