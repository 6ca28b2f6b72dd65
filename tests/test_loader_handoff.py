"""CPU model of the 16-bit kernel's loader warps and their hand-offs (cuda_src/mla/splitkv_kernel.cu,
run_loads and run_requests): four loader warps and eight consumer warps, mbarriers waited by parity,
named barriers, TMA loads landing whenever they do.

Per request the loader warps wait ``bar_next_request`` (the consumers are done with the request
before); warp 0 issues Q and, where the page is one piece (page_block_size >= 64), warps 0 and 1
issue the loads: the first two pages, then page k into buffer k % 2 once the consumers announce
(``bar_refill``) that they are done with page k - 2, warp 0 the left half (tiles 0-3) and warp 1 the
right (4-8), each a barrier of its own. Every loader warp then arrives on ``bar_loads_issued``.
Each consumer warp waits for Q, then for both halves of every page, whose WGMMAs all warps issue
(a named barrier), after which thread 0 announces the refills; then it waits ``bar_loads_issued``
and meets the others at reduce_row_sums' barrier, after which thread 0 arrives on
``bar_next_request``; the request ends at a second barrier.

A waiter must trail its barrier by at most one phase, or it finds the parity of a later phase and
waits for ever (docs/perf-notes.md sections 29, 30, 47). Two orders broke that, and each negative
test shows the model catching one: the consumer warps waiting ``bar_loads_issued`` after
reduce_row_sums' barrier (until session 37; the loaders could finish a next request without
pages and complete the barrier's next phase before a slower warp waited: a hang under
compute-sanitizer, section 47), and warps 2 and 3, which load nothing, waiting for the refills
(until session 38; nothing the consumers wait for follows their waits, so they could fall two
phases behind: a hang in 2 of 25 bf16 profiles, section 48). Seeds: the ``rng`` fixture (tests/conftest.py).
"""
from __future__ import annotations

import numpy as np
from barrier_model import Barrier, failing_runs

CONSUMER_WARPS, LOADER_WARPS = 8, 4
HALVES = 2                                           # tiles 0-3 (warp 0's refills), 4-8 (warp 1's)


class NamedBarrier:
    """bar.sync for a fixed number of warps."""

    def __init__(self, warps: int):
        self.warps, self.arrived, self.generation = warps, 0, 0

    def sync(self):
        generation = self.generation
        self.arrived += 1
        if self.arrived == self.warps:
            self.arrived, self.generation = 0, generation + 1
        yield lambda: self.generation > generation


class Cta:
    def __init__(self):
        self.q = Barrier(1)                          # Q's bytes (expect_tx by loader warp 0)
        # [half][buffer]: a page half's bytes (thread 0's expect_tx, the loads' bytes), and the
        # consumers' announcement that the buffer's half may be refilled
        self.tiles = [[Barrier(1) for _ in range(2)] for _ in range(HALVES)]
        self.refill = [[Barrier(1) for _ in range(2)] for _ in range(HALVES)]
        self.loads_issued = Barrier(LOADER_WARPS)
        self.next_request = Barrier(1)
        self.page_done = NamedBarrier(CONSUMER_WARPS)    # the page's WGMMAs, issued by every warp
        self.sums = NamedBarrier(CONSUMER_WARPS)         # reduce_row_sums
        self.request_end = NamedBarrier(CONSUMER_WARPS)
        self.in_flight = []                              # barriers whose TMA bytes are still to land


def parity_waits(counts: list[int], index: int):
    """The parity of the next wait on barrier ``index`` of a group (each waiter counts its own)."""
    parity = counts[index] & 1
    counts[index] += 1
    return parity


def loader_warp(cta: Cta, warp: int, pages: list[int], idle_warps_wait: bool):
    role, loads = warp % 2, warp < 2                 # page_block_size >= 64: warps 2, 3 load nothing
    refills = [0] * (HALVES * 2)
    for req, n in enumerate(pages):
        if req > 0:
            yield lambda req=req: cta.next_request.passed((req - 1) & 1)
        if warp == 0:
            cta.q.arrive(tx=1)
            cta.in_flight.append(cta.q)
            if n:
                cta.in_flight += [cta.tiles[half][k] for k in range(min(n, 2)) for half in range(HALVES)]
        yield None
        if loads or idle_warps_wait:
            for k in range(2, n):
                barrier = cta.refill[role][k % 2]
                parity = parity_waits(refills, role * 2 + k % 2)
                yield lambda barrier=barrier, parity=parity: barrier.passed(parity)
                if loads:
                    cta.in_flight.append(cta.tiles[role][k % 2])
        cta.loads_issued.arrive()


def consumer_warp(cta: Cta, warp: int, pages: list[int], wait_before_sums: bool):
    tiles = [0] * (HALVES * 2)
    for req, n in enumerate(pages):
        yield lambda req=req: cta.q.passed(req & 1)
        for k in range(n):
            for half in range(HALVES):
                barrier = cta.tiles[half][k % 2]
                if warp == 0:
                    barrier.arrive(tx=1)             # expect_tx: the half's bytes
                parity = parity_waits(tiles, half * 2 + k % 2)
                yield lambda barrier=barrier, parity=parity: barrier.passed(parity)
            yield from cta.page_done.sync()
            if warp == 0 and k + 2 < n:
                for half in range(HALVES):
                    cta.refill[half][k % 2].arrive()
        if wait_before_sums:
            yield lambda req=req: cta.loads_issued.passed(req & 1)
        yield from cta.sums.sync()
        if not wait_before_sums:
            yield lambda req=req: cta.loads_issued.passed(req & 1)
        if warp == 0 and req + 1 < len(pages):
            cta.next_request.arrive()
        yield None                                   # the output
        if req + 1 < len(pages):
            yield from cta.request_end.sync()


def run_requests(rng: np.random.Generator, wait_before_sums: bool = True, idle_warps_wait: bool = False,
                 requests: int = 12, max_pages: int = 12) -> None:
    """Random interleaving of the warps and the loads' landing over requests of 0 to ``max_pages``
    pages, each warp at a speed of its own (a weight in its choice, from 1 to 1000: the slow warp of
    an instrumented or crowded SM); AssertionError on a hang (no warp can go on before all are
    done) or on a lost arrival."""
    cta = Cta()
    pages = [int(n) for n in rng.integers(0, max_pages + 1, requests)]
    warps = [consumer_warp(cta, w, pages, wait_before_sums) for w in range(CONSUMER_WARPS)]
    warps += [loader_warp(cta, w, pages, idle_warps_wait) for w in range(LOADER_WARPS)]
    speed = np.append(10.0 ** rng.uniform(0, 3, len(warps)), 10.0 ** rng.uniform(0, 3))   # [-1]: the loads
    waiting = [None] * len(warps)                    # each warp's wait, None: it can go on
    running = set(range(len(warps)))
    while running:
        ready = [w for w in running if waiting[w] is None or waiting[w]()]
        ready += [-1] * bool(cta.in_flight)
        assert ready, "hang: " + ", ".join(f"warp {w}" for w in sorted(running))
        bounds = np.cumsum(speed[ready])
        w = ready[int(np.searchsorted(bounds, rng.random() * bounds[-1], side="right"))]
        if w < 0:                                    # a load lands
            cta.in_flight.pop(int(rng.integers(len(cta.in_flight)))).complete_tx(1)
            continue
        try:
            waiting[w] = next(warps[w])
        except StopIteration:
            running.remove(w)
    assert not cta.in_flight


def test_kernel_handoffs_never_hang(rng):
    for _ in range(100):
        run_requests(rng)


def test_wait_after_sums_hangs(rng):
    hangs = failing_runs(lambda: run_requests(rng, wait_before_sums=False, max_pages=2), 20)
    assert hangs > 0, "the model no longer shows the wait after reduce_row_sums hanging"


def test_idle_loader_warps_waiting_for_refills_hang(rng):
    hangs = failing_runs(lambda: run_requests(rng, idle_warps_wait=True), 60)
    assert hangs > 0, "the model no longer shows warps that load nothing hanging on the refills"
