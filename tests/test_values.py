"""Bad values in the integer arrays, checked by the kernels (flashmla_cupy/errors.py).

Every kind of bad length and block id (negative, just past the bound, 2**30, the int32 extremes)
in one request of a batch, in each mode: that request's out rows and lse entries are NaN (written
by the kernels: the outputs start finite), the other requests match the float64 reference, and
the error is raised by the next call ("async", the default; or by ``check_errors()``), at the
call ("sync"), or never ("off"). Also: a negative length into ``get_mla_metadata``, a bad value
inside a request split over many SM parts (NaN through the combine kernel), scheduler metadata
that does not belong to the batch (or was computed for sparse decoding), bad values in CUDA-graph
replays, and, last, a correct call showing that the CUDA context survived all of it.

Every test leaves the error record clear (an autouse fixture checks before and after), so that no
error leaks into another test. compute-sanitizer memcheck runs similar cases:
``tools/check_mla.py --set bad-values`` (tools/sanitize.sh).
"""
from __future__ import annotations

import dataclasses
import re

import cupy
import numpy as np
import pytest

import flashmla_cupy
from flashmla_cupy import errors
from flashmla_cupy.testing import (FOREIGN_METADATA, METADATA_KIND_ERROR, PAGE, SCHEDULE_ERROR, SENTINEL, BadValue,
                                   apply_bad_value, bad_value, bad_value_kinds, check_against_reference,
                                   check_bad_value_result, finite_outputs, make_inputs, run_kernel)

pytestmark = pytest.mark.hopper



@pytest.fixture(autouse=True)
def _error_record_clear():
    """The device's error record is clear before and after each test; tests run in "async" mode
    unless they choose another (whatever FLASHMLA_CUPY_VALUE_CHECKS says)."""
    device = cupy.cuda.runtime.getDevice()
    cupy.cuda.Device().synchronize()
    leaked = errors.record(device).take()
    assert leaked is None, f"an earlier test left an unreported error in the record: {leaked}"
    with flashmla_cupy.value_checks("async"):
        yield
    cupy.cuda.Device().synchronize()
    leaked = errors.record(device).take()
    assert leaked is None, f"the test left an unreported error in the record: {leaked}"


# --------------------------------------------------------------------------------------------
# Batches and bad values
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Batch:
    seqlens: tuple
    s_q: int
    h_q: int
    h_kv: int
    causal: bool
    dtype: str
    request: int            # the request given the bad value
    page_size: int = PAGE

    @property
    def rows_per_kv(self) -> int:
        return self.s_q * self.h_q // self.h_kv


# 6 requests each (one of length 0 or 1, whose unused block-table columns hold garbage that must
# never be read); the bad request is processed whole in some, split over SM parts in others; cache
# pages smaller than a kernel page (64 tokens), and larger.
BATCHES = {
    "sq1-hq16-bf16": Batch((100, 200, 300, 64, 0, 1000), 1, 16, 1, False, "bf16", 2),
    "sq2-hq128-causal-bf16": Batch((900, 5, 2000, 64, 130, 1), 2, 128, 1, True, "bf16", 0),
    "sq1-hq128-fp16": Batch((700, 3000, 64, 65, 1, 2), 1, 128, 1, False, "fp16", 3),
    "sq2-hq32-hkv2-bf16": Batch((129, 3000, 64, 65, 1, 900), 2, 32, 2, False, "bf16", 5),
    "sq1-hq16-page1-bf16": Batch((100, 64, 1, 3, 0, 700), 1, 16, 1, False, "bf16", 5, page_size=1),
    "sq1-hq64-page16-bf16": Batch((300, 5, 2000, 17, 0, 640), 1, 64, 1, False, "bf16", 3, page_size=16),
    "sq2-hq128-page256-causal-fp16": Batch((900, 5, 3000, 257, 130, 1), 2, 128, 1, True, "fp16", 2, page_size=256),
    # the FP8 cache: its producer warpgroup reads the block table (alone, and in 2-CTA pairs)
    "sq1-hq16-fp8": Batch((100, 200, 300, 64, 0, 1000), 1, 16, 1, False, "fp8", 5),
    "sq1-hq16-page16-fp8": Batch((100, 200, 17, 64, 0, 1000), 1, 16, 1, False, "fp8", 2, page_size=16),
    "sq2-hq128-page16-causal-fp8": Batch((900, 5, 2000, 64, 130, 1), 2, 128, 1, True, "fp8", 2, page_size=16),
    # ... and with an e4m3 q
    "sq2-hq64-page1-causal-fp8q": Batch((300, 5, 700, 64, 0, 129), 2, 64, 1, True, "fp8q", 5, page_size=1),
}

VALUE_CASES = [(b, *k) for b in BATCHES for k in bad_value_kinds(BATCHES[b].causal)]
VALUE_IDS = [f"{b}-{arg}-{page + '-' if page else ''}{name}" for b, arg, name, page in VALUE_CASES]


def good_value(inp, bad: BadValue) -> int:
    if bad.argument == "cache_seqlens":
        return int(inp.seqlens[bad.request])
    return int(inp.block_table[bad.request, bad.column])


def check_message(error: Exception, inp, bad: BadValue) -> None:
    """The message names the argument, the index, the bound and the value."""
    message = str(error)
    i = bad.request
    if bad.argument == "cache_seqlens":
        pages = inp.block_table.shape[1]
        start = (f"cache_seqlens[{i}] must be in [0, {pages * inp.page_size}] (block_table holds {pages} pages "
                 f"of {inp.page_size} tokens per request)")
    else:
        start = (f"block_table[{i}, {bad.column}] must be a block of k_cache (0 <= id < {inp.k_cache.shape[0]}), "
                 f"since request {i} uses it")
    assert message.startswith(start), f"message should start with {start!r}: {message}"
    assert re.search(rf"; got {bad.value}(?!\d)", message), f"message should say 'got {bad.value}': {message}"


@pytest.fixture(scope="module")
def bases():
    """Per batch: inputs and metadata from the good lengths, made once (tests use copies of the
    integer arrays)."""
    made = {}
    yield made
    made.clear()


def fresh(bases, name: str):
    """``(inp, metadata, num_splits)`` of batch ``name``: its own block table and lengths."""
    if name not in bases:
        batch = BATCHES[name]
        inp = make_inputs(np.random.default_rng(list(BATCHES).index(name)), list(batch.seqlens), batch.s_q,
                          batch.h_q, batch.h_kv, batch.dtype, page_size=batch.page_size)
        meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, batch.rows_per_kv, batch.h_kv)
        bases[name] = (inp, meta, splits)
    inp, meta, splits = bases[name]
    return dataclasses.replace(inp, block_table=inp.block_table.copy(), cache_seqlens=inp.cache_seqlens.copy()), \
        meta, splits


def with_bad_value(bases, name: str, argument: str, value_name: str, page: str):
    """Batch ``name`` (fresh integer arrays) with one bad value written, the good value it
    replaced, and finite outputs: ``(batch, inp, meta, splits, bad, good, out, lse)``."""
    batch = BATCHES[name]
    inp, meta, splits = fresh(bases, name)
    bad = bad_value(inp, batch.request, argument, value_name, page)
    good = good_value(inp, bad)
    apply_bad_value(inp, bad)
    return (batch, inp, meta, splits, bad, good, *finite_outputs(inp))


def call(inp, meta, splits, causal, out, lse, **kwargs):
    return flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, meta,
                                                splits, causal=causal, out=out, lse=lse, **inp.cache_kwargs(),
                                                **kwargs)


def assert_record_clear() -> None:
    cupy.cuda.Device().synchronize()
    assert errors.record(cupy.cuda.runtime.getDevice()).words[0] == 0, "an error was recorded"


# --------------------------------------------------------------------------------------------
# Every bad value, every mode
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,argument,value_name,page", VALUE_CASES, ids=VALUE_IDS)
def test_async_bad_value_gives_nan_rows_and_an_error_at_the_next_call(bases, name, argument, value_name, page):
    batch, inp, meta, splits, bad, good, out, lse = with_bad_value(bases, name, argument, value_name, page)
    call(inp, meta, splits, batch.causal, out, lse)             # returns: nothing waits for the GPU
    cupy.cuda.Device().synchronize()
    check_bad_value_result(inp, bad, out, lse, batch.causal, batch.dtype)
    with pytest.raises(ValueError) as e:                        # the next call on the device
        flashmla_cupy.get_mla_metadata(cupy.asarray(inp.seqlens), batch.rows_per_kv, batch.h_kv)
    check_message(e.value, inp, bad)
    assert "found on device" in str(e.value)
    # Reported once: the call after that runs, and with the value fixed every request is right.
    apply_bad_value(inp, bad, good)
    out, lse = finite_outputs(inp)
    call(inp, meta, splits, batch.causal, out, lse)
    check_against_reference(inp, out, lse, batch.causal, batch.dtype)
    flashmla_cupy.check_errors()


@pytest.mark.parametrize("name,argument,value_name,page", VALUE_CASES, ids=VALUE_IDS)
def test_sync_bad_value_raises_at_the_call(bases, name, argument, value_name, page):
    batch, inp, meta, splits, bad, _, out, lse = with_bad_value(bases, name, argument, value_name, page)
    with flashmla_cupy.value_checks("sync"):
        with pytest.raises(ValueError) as e:
            call(inp, meta, splits, batch.causal, out, lse)
        check_message(e.value, inp, bad)
        check_bad_value_result(inp, bad, out, lse, batch.causal, batch.dtype)   # the call ran, then raised
        flashmla_cupy.check_errors()                            # reported once


@pytest.mark.parametrize("name,argument,value_name,page", VALUE_CASES, ids=VALUE_IDS)
def test_off_bad_value_gives_nan_rows_and_no_error(bases, name, argument, value_name, page):
    batch, inp, meta, splits, bad, _, out, lse = with_bad_value(bases, name, argument, value_name, page)
    with flashmla_cupy.value_checks("off"):
        call(inp, meta, splits, batch.causal, out, lse)
        assert_record_clear()                                   # nothing recorded
        check_bad_value_result(inp, bad, out, lse, batch.causal, batch.dtype)
        flashmla_cupy.get_mla_metadata(cupy.asarray(inp.seqlens), batch.rows_per_kv, batch.h_kv)
        flashmla_cupy.check_errors()


@pytest.mark.parametrize("argument,value_name,page", [("cache_seqlens", "2**31-1", ""), ("block_table", "-1", "first")])
def test_check_errors_synchronizes_and_raises(bases, argument, value_name, page):
    name = "sq1-hq128-fp16"
    batch = BATCHES[name]
    inp, meta, splits = fresh(bases, name)
    bad = bad_value(inp, batch.request, argument, value_name, page)
    apply_bad_value(inp, bad)
    out, lse = finite_outputs(inp)
    call(inp, meta, splits, batch.causal, out, lse)
    with pytest.raises(ValueError) as e:                        # no synchronize before: check_errors does it
        flashmla_cupy.check_errors()
    check_message(e.value, inp, bad)
    flashmla_cupy.check_errors()                                # reported once
    flashmla_cupy.get_mla_metadata(cupy.asarray(inp.seqlens), batch.rows_per_kv, batch.h_kv)
    check_bad_value_result(inp, bad, out, lse, batch.causal, batch.dtype)


@pytest.mark.parametrize("value_name", ["capacity+1", "2**30", "2**31-1"])
def test_bad_length_in_the_metadata_too(value_name):
    """The usual mistake: the same bad lengths go to get_mla_metadata (which accepts any
    positive length) and to the call."""
    batch = Batch((300, 100, 5000, 64, 1, 700), 1, 64, 1, False, "bf16", 1)
    inp = make_inputs(np.random.default_rng(11), list(batch.seqlens), batch.s_q, batch.h_q, batch.h_kv, batch.dtype)
    bad = bad_value(inp, batch.request, "cache_seqlens", value_name)
    apply_bad_value(inp, bad)
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, batch.rows_per_kv, batch.h_kv)
    out, lse = finite_outputs(inp)
    call(inp, meta, splits, batch.causal, out, lse)
    with pytest.raises(ValueError) as e:
        flashmla_cupy.check_errors()
    check_message(e.value, inp, bad)
    check_bad_value_result(inp, bad, out, lse, batch.causal, batch.dtype)


# --------------------------------------------------------------------------------------------
# A negative length into get_mla_metadata
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["async", "sync", "off"])
def test_negative_length_into_get_mla_metadata(mode):
    batch = Batch((300, 100, 5000, 64, 0, 2), 2, 16, 1, True, "bf16", 1)
    inp = make_inputs(np.random.default_rng(12), list(batch.seqlens), batch.s_q, batch.h_q, batch.h_kv, batch.dtype)
    bad = BadValue("cache_seqlens", 1, -5)
    apply_bad_value(inp, bad)
    shapes = flashmla_cupy.metadata_shapes(len(batch.seqlens), batch.rows_per_kv, batch.h_kv)
    meta, splits = cupy.full(shapes[0], -7, dtype=np.int32), cupy.full(shapes[1], -7, dtype=np.int32)
    out, lse = finite_outputs(inp)
    with flashmla_cupy.value_checks(mode):
        if mode == "sync":
            with pytest.raises(ValueError, match=r"^cache_seqlens\[1\] must be >= 0; got -5"):
                flashmla_cupy.get_mla_metadata(inp.cache_seqlens, batch.rows_per_kv, batch.h_kv, out=(meta, splits))
        else:
            flashmla_cupy.get_mla_metadata(inp.cache_seqlens, batch.rows_per_kv, batch.h_kv, out=(meta, splits))
            if mode == "async":
                with pytest.raises(ValueError, match=r"^cache_seqlens\[1\] must be >= 0; got -5"):
                    flashmla_cupy.check_errors()
            assert_record_clear()
        # The length was scheduled as 0.
        zero = inp.cache_seqlens.copy()
        zero[1] = 0
        want_meta, want_splits = flashmla_cupy.get_mla_metadata(zero, batch.rows_per_kv, batch.h_kv)
        assert bool((meta == want_meta).all()) and bool((splits == want_splits).all())
        # The split-KV kernel then finds the length outside [0, capacity]: NaN for the request.
        if mode == "sync":
            with pytest.raises(ValueError) as e:
                call(inp, meta, splits, batch.causal, out, lse)
            check_message(e.value, inp, bad)
        else:
            call(inp, meta, splits, batch.causal, out, lse)
            cupy.cuda.Device().synchronize()
            if mode == "async":
                with pytest.raises(ValueError) as e:
                    flashmla_cupy.get_mla_metadata(zero, batch.rows_per_kv, batch.h_kv)   # the next call
                check_message(e.value, inp, bad)
            assert_record_clear()
        check_bad_value_result(inp, bad, out, lse, batch.causal, batch.dtype)
        flashmla_cupy.check_errors()


# --------------------------------------------------------------------------------------------
# A request split over many SM parts: NaN through the combine kernel
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("what", ["block-in-the-middle", "block-on-the-last-page", "length-2**30", "length--1"])
def test_bad_value_in_a_request_split_over_many_parts(what, dtype):
    batch = Batch((70000, 10, 10), 1, 128, 1, False, dtype, 0)
    inp = make_inputs(np.random.default_rng(13), list(batch.seqlens), batch.s_q, batch.h_q, batch.h_kv, batch.dtype)
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, batch.rows_per_kv, batch.h_kv)
    assert int(splits[1]) - int(splits[0]) > 2, "request 0 should have several splits"
    pages = -(-70000 // PAGE)
    bad = {"block-in-the-middle": BadValue("block_table", 0, -3, column=pages // 2),
           "block-on-the-last-page": BadValue("block_table", 0, inp.k_cache.shape[0], column=pages - 1),
           "length-2**30": BadValue("cache_seqlens", 0, 2**30),
           "length--1": BadValue("cache_seqlens", 0, -1)}[what]
    apply_bad_value(inp, bad)
    out, lse = finite_outputs(inp)
    call(inp, meta, splits, batch.causal, out, lse)
    with pytest.raises(ValueError) as e:
        flashmla_cupy.check_errors()
    check_message(e.value, inp, bad)
    check_bad_value_result(inp, bad, out, lse, batch.causal, batch.dtype)


# --------------------------------------------------------------------------------------------
# Scheduler metadata that does not belong to the batch
# --------------------------------------------------------------------------------------------

# (name, edit of (metadata, num_splits, rng), whether the kernels must report it): the batch's
# request 0 is split, and SM part 0 starts it, so a wrong split index there is always found.


@pytest.mark.parametrize("garbage,edit,reported", FOREIGN_METADATA, ids=[g[0] for g in FOREIGN_METADATA])
def test_metadata_of_another_batch_is_survived_and_reported(garbage, edit, reported):
    rng = np.random.default_rng(14)
    inp = make_inputs(rng, [3000, 100, 5000, 1, 0, 700], 1, 16, 1, "bf16")
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 16, 1)
    assert int(splits[1]) > 1, "request 0 should have several splits"
    edit(meta, splits, rng)
    out, lse = finite_outputs(inp)
    call(inp, meta, splits, False, out, lse)                    # its outputs are unspecified
    cupy.cuda.Device().synchronize()                            # the context survived
    if reported:
        with pytest.raises(ValueError, match=f"^{SCHEDULE_ERROR}"):
            flashmla_cupy.check_errors()
    else:
        try:
            flashmla_cupy.check_errors()                        # such metadata may look valid
        except ValueError as e:
            assert str(e).startswith(SCHEDULE_ERROR), str(e)
    out, lse = run_kernel(inp, causal=False)                    # a correct call afterwards
    check_against_reference(inp, out, lse, False, "bf16")
    flashmla_cupy.check_errors()


def test_metadata_of_another_batch_raises_at_the_call_in_sync_mode():
    inp = make_inputs(np.random.default_rng(15), [3000, 100, 5000, 1], 1, 16, 1, "bf16")
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 16, 1)
    splits.fill(10**9)
    out, lse = finite_outputs(inp)
    with flashmla_cupy.value_checks("sync"), pytest.raises(ValueError, match=f"^{SCHEDULE_ERROR}"):
        call(inp, meta, splits, False, out, lse)
    flashmla_cupy.check_errors()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_sparse_metadata_in_a_dense_call_is_reported(mode):
    """Metadata computed for sparse decoding (s_q 1, h_q 16: the dense call's shapes) records its
    topk in every row; the dense split-KV kernel finds it and reports it."""
    inp = make_inputs(np.random.default_rng(16), [3000, 100, 5000, 1], 1, 16, 1, "bf16")
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 16, 1, 16, True, 2048)
    assert (meta.shape, splits.shape) == flashmla_cupy.metadata_shapes(4, 16, 1)
    message = "^" + re.escape(METADATA_KIND_ERROR + "they were computed for sparse decoding with topk=2048; "
                              "this call is dense (no indices)")
    out, lse = finite_outputs(inp)
    with flashmla_cupy.value_checks(mode):
        if mode == "sync":
            with pytest.raises(ValueError, match=message):
                call(inp, meta, splits, False, out, lse)
        else:
            call(inp, meta, splits, False, out, lse)
            with pytest.raises(ValueError, match=message):
                flashmla_cupy.check_errors()
    out, lse = run_kernel(inp, causal=False)                    # a correct call afterwards
    check_against_reference(inp, out, lse, False, "bf16")
    flashmla_cupy.check_errors()


# --------------------------------------------------------------------------------------------
# CUDA graphs: replays read the buffers' current values, and record what they find
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["async", "sync"])
def test_bad_value_in_a_cuda_graph(mode):
    batch = Batch((500, 1000, 64, 3000, 0, 200), 2, 64, 1, True, "bf16", 1)
    inp = make_inputs(np.random.default_rng(16), list(batch.seqlens), batch.s_q, batch.h_q, batch.h_kv, batch.dtype)
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, batch.rows_per_kv, batch.h_kv)
    out, lse = finite_outputs(inp)
    ws = flashmla_cupy.get_mla_workspace(inp.q, inp.k_cache, meta)
    bad = BadValue("block_table", 1, -2**31, column=0)
    good = good_value(inp, bad)
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())      # the inputs were made on the default stream
    with flashmla_cupy.value_checks(mode), stream:
        call(inp, meta, splits, batch.causal, out, lse, workspace=ws)    # warm: modules loaded, plan built
        stream.synchronize()
        apply_bad_value(inp, bad)                                         # the bad value is in the buffer at capture
        stream.begin_capture()
        call(inp, meta, splits, batch.causal, out, lse, workspace=ws)    # "sync" does not synchronize here
        graph = stream.end_capture()
        out[...] = SENTINEL
        lse[...] = SENTINEL
        graph.launch(stream)
        stream.synchronize()
        check_bad_value_result(inp, bad, out, lse, batch.causal, batch.dtype)
        with pytest.raises(ValueError) as e:                    # the next eager call reports the replay's error
            flashmla_cupy.get_mla_metadata(inp.cache_seqlens, batch.rows_per_kv, batch.h_kv, stream=stream)
        check_message(e.value, inp, bad)
        apply_bad_value(inp, bad, good)                                   # fixed in place: the next replay is right
        graph.launch(stream)
        stream.synchronize()
    check_against_reference(inp, out, lse, batch.causal, batch.dtype)
    flashmla_cupy.check_errors()


# --------------------------------------------------------------------------------------------
# Last: the CUDA context survived everything above
# --------------------------------------------------------------------------------------------

def test_context_is_healthy_after_everything_above():
    for dtype in ("bf16", "fp16"):
        inp = make_inputs(np.random.default_rng(17), [4096, 1, 0, 777, 64, 65] * 2, 2, 128, 1, dtype)
        out, lse = run_kernel(inp, causal=True)                 # garbage in unused block-table columns
        check_against_reference(inp, out, lse, True, dtype)
    flashmla_cupy.check_errors()
