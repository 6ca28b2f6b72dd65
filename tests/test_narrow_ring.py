"""CPU model of the narrow kernel's page ring (cuda_src/mla/fp8_narrow_kernel.cu): one loading
warp, two consumer groups taking the pages in turn, FP8_NARROW_STAGES stages, mbarriers waited by
parity, TMA loads that may land in any order.

The kernel's rule, modelled here: page n lands in stage n % S and signals "full" barrier
[n % G][n % S], which its group waits with parity (n / (S G)) & 1; the loader waits "empty"
[n % S] with parity (n / S - 1) & 1 before reusing a stage. With one "full" barrier per stage
(the kernel until session 25) a group could take the other group's phase for its own page and
read old bytes, or the loader's arrival would find a phase with none left: the launch failures
and hangs of docs/perf-notes.md section 29. The second test shows the model catching that design,
so that the first one's passing means something. Seeds: the ``rng`` fixture (tests/conftest.py).
"""
from __future__ import annotations

import numpy as np
from barrier_model import Barrier, failing_runs

from flashmla_cupy import constants

STAGES = constants.FP8_NARROW_STAGES
GROUPS = constants.FP8_NARROW_THREADS // 128 - 1   # and a loading warpgroup


def run_ring(rng: np.random.Generator, full_per_group: bool, pages: int = 120) -> None:
    """Random interleaving of the loader, the TMA completions (in any order) and the groups;
    AssertionError when a group reads a stage that does not hold its page, or on a lost arrival;
    returns when every page is consumed (a hang fails the step bound)."""
    full = [[Barrier(1) for _ in range(STAGES)] for _ in range(GROUPS if full_per_group else 1)]
    empty = [Barrier(1) for _ in range(STAGES)]      # a group's warps as one arrival
    held = [None] * STAGES                           # the page whose bytes a stage holds
    landing = []                                     # (stage, page, barrier) in flight
    loaded, next_page = 0, list(range(GROUPS))
    for _ in range(100 * pages):
        if min(next_page) >= pages:
            return
        action = rng.integers(3)
        if action == 0 and loaded < pages:           # the loading warp
            stage = loaded % STAGES
            if loaded >= STAGES and not empty[stage].passed((loaded // STAGES - 1) & 1):
                continue
            bar = full[loaded % GROUPS if full_per_group else 0][stage]
            bar.arrive(tx=1)
            landing.append((stage, loaded, bar))
            loaded += 1
        elif action == 1 and landing:                # a TMA load lands, not always the oldest
            stage, page, bar = landing.pop(int(rng.integers(len(landing))))
            held[stage] = page
            bar.complete_tx(1)
        else:                                        # a consumer group
            group = int(rng.integers(GROUPS))
            n = next_page[group]
            if n >= pages:
                continue
            stage = n % STAGES
            if full_per_group:
                bar, parity = full[group][stage], (n // (STAGES * GROUPS)) & 1
            else:
                bar, parity = full[0][stage], (n // STAGES) & 1
            if not bar.passed(parity):
                continue
            assert held[stage] == n, f"group {group} read stage {stage} for page {n}, holding page {held[stage]}"
            empty[stage].arrive()
            next_page[group] += GROUPS
    raise AssertionError("the ring stopped: a hang")


def test_kernel_ring_never_reads_another_page(rng):
    assert STAGES % 2 == 1 and GROUPS == 2, "the kernel's static_asserts"
    for _ in range(200):
        run_ring(rng, full_per_group=True)


def test_one_full_barrier_per_stage_fails(rng):
    failures = failing_runs(lambda: run_ring(rng, full_per_group=False), 200)
    assert failures > 0, "the model no longer shows the shared barrier's aliasing"
