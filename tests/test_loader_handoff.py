"""CPU model of the 16-bit kernel's hand-off between requests (cuda_src/mla/splitkv_kernel.cu):
four loader warps and eight consumer warps, mbarriers waited by parity, named barriers, Q's TMA
landing whenever it does.

Per request, the loader warps wait ``bar_next_request`` (the consumers are done with the request
before), warp 0 issues Q, and each warp arrives on ``bar_loads_issued`` once the request's loads
are issued; for a request of at most two pages (the model's) nothing else holds them. Each
consumer warp waits for Q, then (the kernel) waits ``bar_loads_issued`` and meets the others at
reduce_row_sums' barrier, after which thread 0 arrives on ``bar_next_request``; the request ends
at a second barrier. Until session 37 the warps waited ``bar_loads_issued`` after that barrier and
thread 0 arrived after its own wait: the loaders could then finish the next request and complete
the barrier's next phase before a slower warp waited, which found the parity of the phase after
its own and waited for ever (a hang under compute-sanitizer, docs/perf-notes.md section 47). The
second test shows the model catching that order. Seeds: the ``rng`` fixture (tests/conftest.py).
"""
from __future__ import annotations

import numpy as np
from barrier_model import Barrier, failing_runs

CONSUMER_WARPS, LOADER_WARPS = 8, 4


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
        self.loads_issued = Barrier(LOADER_WARPS)
        self.next_request = Barrier(1)
        self.sums = NamedBarrier(CONSUMER_WARPS)     # reduce_row_sums
        self.request_end = NamedBarrier(CONSUMER_WARPS)
        self.q_in_flight = 0


def loader_warp(cta: Cta, warp: int, requests: int):
    for req in range(requests):
        if req > 0:
            yield lambda req=req: cta.next_request.passed((req - 1) & 1)
        if warp == 0:
            cta.q.arrive(tx=1)
            cta.q_in_flight += 1
        yield None                                   # the request's first pages
        cta.loads_issued.arrive()


def consumer_warp(cta: Cta, warp: int, requests: int, wait_before_sums: bool):
    for req in range(requests):
        yield lambda req=req: cta.q.passed(req & 1)
        if wait_before_sums:
            yield lambda req=req: cta.loads_issued.passed(req & 1)
        yield from cta.sums.sync()
        if not wait_before_sums:
            yield lambda req=req: cta.loads_issued.passed(req & 1)
        if warp == 0 and req + 1 < requests:
            cta.next_request.arrive()
        yield None                                   # the output
        if req + 1 < requests:
            yield from cta.request_end.sync()


def run_requests(rng: np.random.Generator, wait_before_sums: bool, requests: int = 12) -> None:
    """Random interleaving of the warps and Q's landing; AssertionError on a hang (no warp can go
    on before all are done) or on a lost arrival."""
    cta = Cta()
    warps = [consumer_warp(cta, w, requests, wait_before_sums) for w in range(CONSUMER_WARPS)]
    warps += [loader_warp(cta, w, requests) for w in range(LOADER_WARPS)]
    waiting = [None] * len(warps)                    # each warp's wait, None: it can go on
    running = set(range(len(warps)))
    while running:
        ready = [w for w in running if waiting[w] is None or waiting[w]()]
        if cta.q_in_flight:
            ready.append(-1)
        assert ready, "hang: " + ", ".join(f"warp {w}" for w in sorted(running))
        w = ready[int(rng.integers(len(ready)))]
        if w < 0:                                    # Q's TMA load lands
            cta.q_in_flight -= 1
            cta.q.complete_tx(1)
            continue
        try:
            waiting[w] = next(warps[w])
        except StopIteration:
            running.remove(w)


def test_kernel_handoff_never_hangs(rng):
    for _ in range(100):
        run_requests(rng, wait_before_sums=True)


def test_wait_after_sums_hangs(rng):
    hangs = failing_runs(lambda: run_requests(rng, wait_before_sums=False), 20)
    assert hangs > 0, "the model no longer shows the wait after reduce_row_sums hanging"
