"""Bad values in the integer arrays, checked by the kernels (flashmla_cupy/errors.py).

Every kind of bad length and block id (``flashmla_cupy.testing.bad_values``: negative, just past
the bound, 2**30, the int32 extremes) in one request: that request's out rows and lse entries are
NaN, the other requests match the float64 reference, the CUDA context survives, and the error is
raised — by the next call ("async", the default), at the call ("sync"), or never ("off").
Scheduler metadata that does not belong to the batch is survived and reported the same way.
compute-sanitizer memcheck runs the same cases: ``SANITIZE_SET=bad-values tools/sanitize.sh``.
"""
from __future__ import annotations

import cupy
import numpy as np
import pytest

import flashmla_cupy
from flashmla_cupy import errors
from flashmla_cupy.testing import (BadValue, apply_bad_value, bad_values, check_against_reference, check_bad_value_result,
                                   make_inputs, poisoned, run_kernel)

pytestmark = pytest.mark.hopper

# (seqlens, s_q, h_q, causal, request given the bad value)
BATCHES = [([100, 200, 300, 64, 0, 1000], 1, 16, False, 2), ([900, 5, 2000, 64], 2, 128, True, 0)]


@pytest.fixture(autouse=True)
def _error_record_left_clear():
    yield
    cupy.cuda.Device().synchronize()
    record = errors.record(cupy.cuda.runtime.getDevice())
    assert record.words[0] == 0, "a test left an unreported error in the record"


def _call(inp, meta, splits, causal, **kwargs):
    b, s_q, h_q = len(inp.seqlens), inp.s_q, inp.h_q
    out, lse = poisoned((b, s_q, h_q, 512), inp.q.dtype), poisoned((b, h_q, s_q), np.float32)
    flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, meta, splits,
                                         causal=causal, out=out, lse=lse, **kwargs)
    return out, lse


# bad_values() lists 5 lengths, then 4 ids for the first page and (without a causal mask) 4 for
# the last: 13 kinds at most (the cases need the GPU arrays, so they are built in the test).
KINDS = [(b, k) for b in range(len(BATCHES)) for k in range(13)]


@pytest.mark.parametrize("batch_index,kind", KINDS, ids=[f"batch{b}-kind{k}" for b, k in KINDS])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_bad_value_gives_nan_rows_and_an_error_at_the_next_call(batch_index, kind, dtype):
    seqlens, s_q, h_q, causal, _ = BATCHES[batch_index]
    inp = make_inputs(np.random.default_rng(), seqlens, s_q, h_q, 1, dtype)
    kinds = bad_values(inp, BATCHES[batch_index][4], causal)
    if kind >= len(kinds):
        pytest.skip("no such kind for this batch (a causal batch has no last-page ids)")
    bad = kinds[kind]
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
    apply_bad_value(inp, bad)
    with flashmla_cupy.value_checks("async"):
        out, lse = _call(inp, meta, splits, causal)           # returns: nothing waits for the GPU
        cupy.cuda.Device().synchronize()
        check_bad_value_result(inp, bad, out, lse, causal, dtype)
        with pytest.raises(ValueError) as e:
            flashmla_cupy.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
        assert str(e.value).startswith(bad.message) and f"got {bad.value}" in str(e.value)
        flashmla_cupy.check_errors()                          # reported once: nothing left


@pytest.mark.parametrize("mode", ["sync", "off"])
def test_sync_mode_raises_at_the_call_and_off_mode_never(mode):
    seqlens, s_q, h_q, causal, request = BATCHES[1]
    inp = make_inputs(np.random.default_rng(), seqlens, s_q, h_q, 1, "bf16")
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
    bad = next(b for b in bad_values(inp, request, causal) if b.argument == "block_table")
    apply_bad_value(inp, bad)
    with flashmla_cupy.value_checks(mode):
        if mode == "sync":
            with pytest.raises(ValueError, match=r"^block_table\[0, 0\] must be a block of k_cache"):
                _call(inp, meta, splits, causal)
        else:
            out, lse = _call(inp, meta, splits, causal)
            flashmla_cupy.check_errors()
            check_bad_value_result(inp, bad, out, lse, causal, "bf16")


def test_negative_length_into_get_mla_metadata():
    inp = make_inputs(np.random.default_rng(), [300, 100, 5000], 1, 64, 1, "bf16")
    inp.cache_seqlens[1] = -7
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 64, 1)
    with pytest.raises(ValueError, match=r"^cache_seqlens\[1\] must be >= 0; got -7"):
        flashmla_cupy.check_errors()
    out, lse = _call(inp, meta, splits, False)
    with pytest.raises(ValueError, match=r"^cache_seqlens\[1\] must be in \[0, "):
        flashmla_cupy.check_errors()
    bad = bad_values(inp, 1, False)[0]
    check_bad_value_result(inp, bad, out, lse, False, "bf16")


def test_bad_block_id_inside_a_request_split_over_many_parts():
    """The bad page is read by one split of the request; the combine kernel makes the row NaN."""
    inp = make_inputs(np.random.default_rng(), [70000, 10, 10], 1, 128, 1, "bf16")
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 128, 1)
    assert int(splits[1]) > 2                                  # request 0 has several splits
    bad = BadValue("block_table", 0, -3, column=600)
    apply_bad_value(inp, bad)
    out, lse = _call(inp, meta, splits, False)
    with pytest.raises(ValueError, match=r"^block_table\[0, 600\] must be a block of k_cache"):
        flashmla_cupy.check_errors()
    check_bad_value_result(inp, bad, out, lse, False, "bf16")


@pytest.mark.parametrize("garbage", ["num_splits-huge", "num_splits-negative", "metadata-begin-negative",
                                     "metadata-random"])
def test_metadata_of_another_batch_is_survived_and_reported(garbage):
    rng = np.random.default_rng()
    inp = make_inputs(rng, [3000, 100, 5000, 1], 1, 16, 1, "bf16")
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 16, 1)
    if garbage == "num_splits-huge":
        splits[...] = 10**9
    elif garbage == "num_splits-negative":
        splits[2:] = -5
    elif garbage == "metadata-begin-negative":
        meta[0, 0] = -3
    else:
        meta[...] = cupy.asarray(rng.integers(-2**31, 2**31 - 1, meta.shape, dtype=np.int64).astype(np.int32))
    _call(inp, meta, splits, False)
    cupy.cuda.Device().synchronize()                           # the context survived
    try:
        flashmla_cupy.check_errors()                          # (random metadata may look valid)
    except ValueError as e:
        assert "must come from get_mla_metadata" in str(e) or "must be" in str(e), str(e)
    out, lse = run_kernel(inp, causal=False)                   # a correct call afterwards
    check_against_reference(inp, out, lse, False, "bf16")
    flashmla_cupy.check_errors()


def test_bad_value_inside_a_cuda_graph():
    inp = make_inputs(np.random.default_rng(), [500, 1000, 64], 2, 64, 1, "bf16")
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 128, 1)
    out, lse = poisoned((3, 2, 64, 512), inp.q.dtype), poisoned((3, 64, 2), np.float32)
    ws = flashmla_cupy.get_mla_workspace(inp.q, inp.k_cache, meta)
    stream = cupy.cuda.Stream(non_blocking=True)

    def call():
        flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, meta,
                                             splits, causal=True, out=out, lse=lse, workspace=ws)

    with stream:
        call()
        stream.begin_capture()
        call()
        graph = stream.end_capture()
        good_table = inp.block_table.copy()
        bad = bad_values(inp, 1, True)[-1]                     # block_table[1, 0] = -2**31
        assert (bad.argument, bad.column, bad.value) == ("block_table", 0, -2**31)
        apply_bad_value(inp, bad)
        graph.launch(stream)
        stream.synchronize()
        check_bad_value_result(inp, bad, out, lse, True, "bf16")
        with pytest.raises(ValueError, match=r"^block_table\[1, 0\]"):
            call()                                             # the next eager call reports the replay's error
        inp.block_table[...] = good_table
        graph.launch(stream)
        stream.synchronize()
    check_against_reference(inp, out, lse, True, "bf16")
    flashmla_cupy.check_errors()


def test_context_is_healthy_after_everything_above():
    inp = make_inputs(np.random.default_rng(), [4096] * 4, 2, 128, 1, "fp16")
    out, lse = run_kernel(inp, causal=True)
    check_against_reference(inp, out, lse, True, "fp16")
    flashmla_cupy.check_errors()
