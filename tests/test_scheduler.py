"""CPU tests of the tile-scheduler model (flashmla_cupy.scheduler).

Random batches are scheduled and the result is checked against what the split-KV and combine
kernels rely on: every page of every request processed exactly once, in order; split counts and
split indices consistent; every part within its payload, and all but the last busy part nearly
full. Small schedules are worked out by hand. Sparse decoding's ``topk`` schedules every request
as topk tokens long and records topk in slot 5 (-1 without). (tests/test_mla.py compares the
model with the metadata kernel on the GPU.) Each test draws a fresh seed, printed (pytest shows
it on failure); ``FLASHMLA_CUPY_TEST_SEED`` replays one.
"""
from __future__ import annotations

import numpy as np
import pytest

from flashmla_cupy import scheduler
from flashmla_cupy.scheduler import FIXED_OVERHEAD_BLOCKS as OVERHEAD
from flashmla_cupy.scheduler import BLOCK_N as PAGE


def check_schedule(seqlens, parts, metadata, num_splits, topk=None):
    """Assert every invariant of a schedule of `seqlens` over `parts` parts (with `topk`: of
    len(seqlens) requests of topk tokens each, sparse decoding)."""
    seqlens = np.asarray(seqlens) if topk is None else np.full(len(seqlens), topk)
    batch = len(seqlens)
    pages = -(-seqlens // PAGE)
    payload = scheduler.payload(seqlens, parts)
    what = f"batch {batch}, {parts} parts, payload {payload}, seqlens[:10] {seqlens[:10].tolist()}"

    assert metadata.dtype == np.int32 and metadata.shape == (parts, scheduler.SCHED_META_INTS), what
    assert num_splits.dtype == np.int32 and num_splits.shape == (batch + 1,), what
    assert (metadata[:, 5] == (-1 if topk is None else topk)).all() and (metadata[:, 6:] == 0).all(), what

    items = scheduler.parts_work(metadata, seqlens)
    by_request = [[] for _ in range(batch)]
    for item in items:
        by_request[item.request].append(item)

    # The parts walk the batch in order: (request, first page) strictly increases.
    walk = [(item.request, item.first_page) for item in items]
    assert walk == sorted(set(walk)), what
    assert [item.part for item in items] == sorted(item.part for item in items), what

    for i, pieces in enumerate(by_request):
        # Every page exactly once: the pieces tile [0, pages) in part order, none empty
        # (a request of length 0 is one piece without pages: its output is still written).
        assert pieces, f"request {i} unscheduled: {what}"
        assert pieces[0].first_page == 0 and pieces[-1].end_page == pages[i], f"request {i}: {what}"
        for before, after in zip(pieces, pieces[1:]):
            assert before.end_page == after.first_page and before.part < after.part, f"request {i}: {what}"
        assert all(p.pages > 0 for p in pieces) or (pages[i] == 0 and len(pieces) == 1), f"request {i}: {what}"
        # Splits: numbered 0, 1, ... in part order; num_splits counts them (1 if never split).
        assert [p.split for p in pieces] == list(range(len(pieces))), f"request {i}: {what}"
        assert num_splits[i + 1] - num_splits[i] == len(pieces), f"request {i}: {what}"
    assert num_splits[0] == 0 and num_splits[-1] == len(items), what
    # The split workspace of flash_mla_with_kvcache has batch + num_sm_parts entries.
    assert len(items) <= batch + parts - 1, what

    busy = sorted({item.part for item in items})
    assert busy == list(range(len(busy))), f"idle parts before busy ones: {what}"
    for part in range(parts):
        begin_req, begin_token, end_req, end_token, begin_split = metadata[part, :5]
        if part in busy:
            # begin_split counts the pieces of begin_req that earlier parts took.
            earlier = sum(p.part < part for p in by_request[begin_req])
            assert begin_split == earlier, f"part {part}: {what}"
        else:
            # Idle: past the last request, as the kernel writes it.
            assert (begin_req, begin_token, end_req, end_token, begin_split) == \
                   (batch, 0, batch - 1, seqlens[-1], 0), f"part {part}: {what}"
    # The walk finished: the last busy part ends with the end of the last request.
    assert tuple(metadata[busy[-1], 2:4]) == (batch - 1, seqlens[-1]), what

    # Balance: no part over the payload; a part stops early only when the next piece would
    # cost no more than the overhead, so all but the last busy part are nearly full.
    costs = scheduler.part_costs(metadata, seqlens)
    assert costs.max() <= payload, what
    assert (costs[busy[:-1]] >= payload - OVERHEAD).all(), f"costs {costs.tolist()}: {what}"


def random_seqlens(rng, kind):
    batch = int(rng.integers(1, 301))
    if kind == "uniform":
        return rng.integers(0, 20001, batch)
    if kind == "zeros":
        return np.zeros(batch, dtype=np.int64)
    if kind == "tiny":
        return rng.integers(0, 4, batch)
    if kind == "pages":                       # exact multiples of the page size, and +-1
        return np.maximum(rng.integers(0, 300, batch) * PAGE + rng.integers(-1, 2, batch), 0)
    if kind == "one_huge":
        return np.array([int(rng.integers(1, 20001))])
    if kind == "huge_among_small":
        seqlens = rng.integers(0, 200, batch)
        seqlens[rng.integers(batch)] = 20000
        return seqlens
    raise ValueError(kind)


KINDS = ["uniform", "zeros", "tiny", "pages", "one_huge", "huge_among_small"]


@pytest.mark.parametrize("kind", KINDS)
def test_random_schedules(rng, kind):
    for _ in range(60):
        seqlens = random_seqlens(rng, kind).astype(np.int32)
        parts = int(rng.choice([1, 2, 132, *rng.integers(1, 133, 3)]))
        metadata, num_splits = scheduler.schedule(seqlens, parts)
        check_schedule(seqlens, parts, metadata, num_splits)


def test_hand_worked_example():
    """seqlens [100, 0, 1000, 64] over 3 parts.

    Pages 2, 0, 16, 1; costs (pages + 5) 7, 5, 21, 6; total 39; payload ceil(39/3) + 5 = 18.
    Part 0: request 0 (7, budget 11 left), request 1 (5, 6 left), then request 2 does not fit:
            6 - 5 = 1 page of it (split 0). Ends at token 64 of request 2.
    Part 1: the rest of request 2 (15 pages + 5 > 18): 18 - 5 = 13 pages, pages 1..13 (split 1).
    Part 2: request 2's last 2 pages (7, split 2; it has 3 splits), request 3 (6). Done.
    num_splits: 1, 1, 3, 1 splits -> prefix sums [0, 1, 2, 5, 6].
    """
    seqlens = [100, 0, 1000, 64]
    assert scheduler.payload(seqlens, 3) == 18
    metadata, num_splits = scheduler.schedule(seqlens, 3)
    np.testing.assert_array_equal(metadata, [[0, 0, 2, 64, 0, -1, 0, 0],
                                             [2, 64, 2, 14 * 64, 1, -1, 0, 0],
                                             [2, 14 * 64, 3, 64, 2, -1, 0, 0]])
    np.testing.assert_array_equal(num_splits, [0, 1, 2, 5, 6])
    W = scheduler.WorkItem
    assert scheduler.parts_work(metadata, seqlens) == [
        W(0, 0, 0, 2, 0), W(0, 1, 0, 0, 0), W(0, 2, 0, 1, 0),
        W(1, 2, 1, 14, 1),
        W(2, 2, 14, 16, 2), W(2, 3, 0, 1, 0)]
    np.testing.assert_array_equal(scheduler.part_costs(metadata, seqlens), [18, 18, 13])
    check_schedule(np.array(seqlens), 3, metadata, num_splits)


def test_hand_worked_idle_parts():
    """One request of one page over 3 parts: cost 6, payload ceil(6/3) + 5 = 7. Part 0 takes
    it whole; parts 1 and 2 are idle: begin at request 1 (= batch), end at request 0's end."""
    assert scheduler.payload([64], 3) == 7
    metadata, num_splits = scheduler.schedule([64], 3)
    np.testing.assert_array_equal(metadata, [[0, 0, 0, 64, 0, -1, 0, 0],
                                             [1, 0, 0, 64, 0, -1, 0, 0],
                                             [1, 0, 0, 64, 0, -1, 0, 0]])
    np.testing.assert_array_equal(num_splits, [0, 1])


def test_hand_worked_small_batch():
    """One request of 1280 tokens (20 pages, cost 25) over 8 parts: payload ceil(25/8) + 5 = 9, so
    each part takes 9 - 5 = 4 pages: four splits of 4 pages, then the last 4 pages fit whole
    (4 + 5 <= 9). 5 splits; parts 5..7 idle. (FlashMLA's 2025-04 scheduler floored the payload at
    2 * 5 = 10: 5 pages a part, 4 parts busy.)"""
    assert scheduler.payload([1280], 8) == 9
    metadata, num_splits = scheduler.schedule([1280], 8)
    np.testing.assert_array_equal(metadata[:, :5], [[0, 0, 0, 256, 0], [0, 256, 0, 512, 1],
                                                    [0, 512, 0, 768, 2], [0, 768, 0, 1024, 3],
                                                    [0, 1024, 0, 1280, 4]] + [[1, 0, 0, 1280, 0]] * 3)
    np.testing.assert_array_equal(num_splits, [0, 5])


def test_hand_worked_sparse_topk():
    """Sparse decoding: 3 query tokens with topk 2048 over 4 parts. The lengths given are ignored
    (the kernel reads only how many there are): every request is 32 pages, cost 37, total 111;
    payload ceil(111/4) + 5 = 33.
    Part 0: request 0 does not fit: 33 - 5 = 28 pages (split 0), ends at token 1792.
    Part 1: request 0's last 4 pages (9, 24 left, split 1), then 24 - 5 = 19 pages of request 1.
    Part 2: request 1's last 13 pages (18, 15 left, split 1), then 10 pages of request 2.
    Part 3: request 2's last 22 pages (27, split 1). Every row records topk 2048 in slot 5."""
    metadata, num_splits = scheduler.schedule([-5, 0, 10**9], 4, topk=2048)
    np.testing.assert_array_equal(metadata, [[0, 0, 0, 1792, 0, 2048, 0, 0],
                                             [0, 1792, 1, 1216, 1, 2048, 0, 0],
                                             [1, 1216, 2, 640, 1, 2048, 0, 0],
                                             [2, 640, 2, 2048, 1, 2048, 0, 0]])
    np.testing.assert_array_equal(num_splits, [0, 2, 4, 6])
    check_schedule([0, 0, 0], 4, metadata, num_splits, topk=2048)


def test_topk_schedules_every_request_as_topk_tokens(rng):
    """With topk the model does what the metadata kernel does with uniform_seqlen = topk: every
    request is topk tokens long whatever its given length (even a negative one), and slot 5
    holds topk (-1 without)."""
    for _ in range(40):
        batch = int(rng.integers(1, 600))
        seqlens = rng.integers(-2**31, 2**31, batch, dtype=np.int64).astype(np.int32)
        topk = int(rng.choice([1, 63, 64, 65, 128, 512, 2048, *rng.integers(1, 20000, 2)]))
        parts = int(rng.choice([1, 2, 66, 132, *rng.integers(1, 133, 2)]))
        metadata, num_splits = scheduler.schedule(seqlens, parts, topk=topk)
        check_schedule(seqlens, parts, metadata, num_splits, topk=topk)
        dense_meta, dense_splits = scheduler.schedule(np.full(batch, topk), parts)
        assert (dense_meta[:, 5] == -1).all()
        np.testing.assert_array_equal(metadata[:, :5], dense_meta[:, :5])
        np.testing.assert_array_equal(metadata[:, 6:], dense_meta[:, 6:])
        np.testing.assert_array_equal(num_splits, dense_splits)


def test_check_schedule_catches_corruption(rng):
    """The invariant checker above fails on schedules that are wrong in each way it guards."""
    seqlens = rng.integers(500, 5000, 40).astype(np.int32)
    metadata, num_splits = scheduler.schedule(seqlens, 16)
    check_schedule(seqlens, 16, metadata, num_splits)
    cut = next(p for p in range(15) if metadata[p, 3] % PAGE == 0 and metadata[p, 2] == metadata[p + 1, 0])

    def corrupted(part, column, delta):
        bad = metadata.copy()
        bad[part, column] += delta
        return bad

    for bad_metadata in (corrupted(cut, 3, PAGE),           # a page processed twice
                         corrupted(cut + 1, 1, PAGE),       # a page skipped
                         corrupted(cut + 1, 4, 1),          # wrong split index
                         corrupted(15, 2, -1)):             # last request never finished
        with pytest.raises(AssertionError):
            check_schedule(seqlens, 16, bad_metadata, num_splits)
    bad_splits = num_splits.copy()
    bad_splits[5] += 1
    with pytest.raises(AssertionError):
        check_schedule(seqlens, 16, metadata, bad_splits)


def test_hand_worked_equal_requests():
    """128 requests of 4096 tokens on 66 parts (DeepSeek decode, h_q = 128, on an H100).

    64 pages + 5 = 69 per request, total 8832, payload ceil(8832 / 66) + 5 = 139. Each part takes
    two whole requests (138); the 1 left is below the overhead, so nothing is split and the
    last 2 parts stay idle.
    """
    seqlens = np.full(128, 4096)
    assert scheduler.payload(seqlens, 66) == 139
    metadata, num_splits = scheduler.schedule(seqlens, 66)
    parts = np.arange(64)
    np.testing.assert_array_equal(metadata[:64, :5], np.stack(
        [2 * parts, 0 * parts, 2 * parts + 1, 0 * parts + 4096, 0 * parts], axis=1))
    np.testing.assert_array_equal(metadata[64:, :5], [[128, 0, 127, 4096, 0]] * 2)
    np.testing.assert_array_equal(num_splits, np.arange(129))
    np.testing.assert_array_equal(scheduler.part_costs(metadata, seqlens), [138] * 64 + [0, 0])
    check_schedule(seqlens, 66, metadata, num_splits)


@pytest.mark.parametrize("sm_count,heads_per_kv,h_kv,want", [
    (132, 128, 1, 66),     # H100, DeepSeek TP 1, s_q = 1: two query blocks per kv head
    (132, 16, 1, 132),
    (132, 256, 1, 33),     # s_q = 2 x 128 heads
    (132, 64, 2, 66),
    (132, 65, 1, 66),      # a partial query block counts as a block
    (78, 64, 100, 1),      # never 0 parts
])
def test_num_sm_parts(sm_count, heads_per_kv, h_kv, want):
    assert scheduler.num_sm_parts(sm_count, heads_per_kv, h_kv) == want


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError):
        scheduler.schedule([], 4)
    with pytest.raises(ValueError):
        scheduler.schedule([10, -1], 4)
    with pytest.raises(ValueError):
        scheduler.schedule([10], 0)
    for topk in (0, -1, True, 2.0, 2**31):
        with pytest.raises(ValueError, match="topk must be"):
            scheduler.schedule([10], 4, topk=topk)
    with pytest.raises(ValueError):
        scheduler.schedule([], 4, topk=64)


def test_schedule_of_huge_lengths_stays_in_int32():
    """The kernel sums costs in 64 bits: lengths up to 2^31 - 1 schedule without overflow, and
    every token it writes into the metadata fits in int32."""
    seqlens = [2**31 - 1] * 200 + [5, 0]
    metadata, num_splits = scheduler.schedule(seqlens, 132)
    assert metadata.dtype == np.int32 and num_splits.dtype == np.int32
    items = scheduler.parts_work(metadata, seqlens)
    covered = {}
    for item in items:
        covered[item.request] = covered.get(item.request, 0) + item.pages
    assert covered == {i: -(-s // 64) for i, s in enumerate(seqlens)}
