"""Seeded random-shape fuzzing of MLA decoding against the float64 reference (Hopper only).

Every shape draws: the batch size; s_q (1-4, sometimes 5-8); h_kv (1 or 2) and h_q (a multiple of
it, at most 128, odd group sizes included); sequence lengths mixing 0, tiny ones, lengths around
page boundaries, medium and long ones (up to 20,000), often one long request among short ones
(the scheduler splits it over several SM parts: the combine path); causal on or off; sometimes a
non-default softmax_scale; spare cache blocks and garbage block-table columns; the cache's page
size (64 in half the shapes, else a power of two from 1 to 512). The inputs come
from ``flashmla_cupy.testing.make_inputs`` (permuted block ids, NaN in every cache slot that no
request may read) and the kernel's out and lse are checked with flashmla_cupy.testing's criteria and
tolerances (``run_kernel``, ``check_against_reference``). One shape in ten is run a second time
with fresh arrays of the same shapes: that call reuses the cached plan of the first and must
re-encode the tensor maps for the new addresses.

    pytest tests/test_fuzz.py -s                                  # 40 shapes per dtype
    pytest tests/test_fuzz.py -s --fuzz-shapes 500                # long run
    pytest tests/test_fuzz.py -s -k bf16 --fuzz-seed S --fuzz-shapes 1    # replay one shape

(or the environment variables ``FLASHMLA_CUPY_FUZZ_SHAPES`` and ``FLASHMLA_CUPY_FUZZ_SEED``).
Shape i of a run with master seed M is drawn from seed M + i and the dtype, so each failure
names the seed that replays that shape alone. The shapes of one dtype run in a single test: all
of them run, failures are collected and reported together at the end; only a CUDA error stops
the run early (the context may be unusable after it).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import cupy
import numpy as np
import pytest

from flashmla_cupy import driver, mla, scheduler
from flashmla_cupy.testing import PAGE, check_against_reference, make_inputs, run_kernel

pytestmark = pytest.mark.hopper

DEFAULT_SHAPES = 40
DTYPE_CODE = {"bf16": 0, "fp16": 1}

# Per-shape budgets (a shape over them loses requests from the end of its batch): the KV cache
# (300k tokens: ~350 MB in 16 bits) and the float64 reference's work, query rows x tokens.
MAX_TOKENS = 300_000
MAX_ROW_TOKENS = 60_000_000
HEADS_PER_KV = (1, 2, 3, 5, 8, 16, 24, 32, 64, 100, 128)
MAX_REPORTED = 50

# Errors after which the CUDA context may be unusable: stop fuzzing.
FATAL_ERRORS = (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError, driver.DriverError)


@dataclass
class Case:
    seed: int
    dtype: str
    seqlens: np.ndarray
    s_q: int
    h_q: int
    h_kv: int
    causal: bool
    softmax_scale: float | None
    spare_blocks: int
    garbage_columns: int
    again: bool               # a second call with fresh arrays (cached plan)
    page_size: int = PAGE

    @property
    def q_rows(self) -> int:
        return self.s_q * (self.h_q // self.h_kv)

    def describe(self) -> str:
        s = self.seqlens
        lengths = s.tolist() if len(s) <= 24 else \
            f"{s[:12].tolist()}... (max {int(s.max())}, {int((s == 0).sum())} zeros, total {int(s.sum())})"
        return (f"seed={self.seed} {self.dtype} b={len(s)} s_q={self.s_q} h_q={self.h_q} h_kv={self.h_kv} "
                f"causal={self.causal} softmax_scale={self.softmax_scale} spare_blocks={self.spare_blocks} "
                f"garbage_columns={self.garbage_columns} again={self.again} page_size={self.page_size} "
                f"seqlens={lengths}")

    def replay(self) -> str:
        return (f"pytest tests/test_fuzz.py -s -k {self.dtype} --fuzz-seed {self.seed} --fuzz-shapes 1")


def draw_seqlen(rng: np.random.Generator) -> int:
    kind = rng.choice(6, p=[0.08, 0.15, 0.25, 0.35, 0.12, 0.05])
    if kind == 0:
        return 0
    if kind == 1:                                                   # tiny (also < s_q: causal rows see nothing)
        return int(rng.integers(1, 17))
    if kind == 2:                                                   # around a page boundary (odd and even page counts)
        return max(1, PAGE * int(rng.integers(1, 13)) + int(rng.integers(-2, 3)))
    if kind == 3:
        return int(rng.integers(1, 2049))
    if kind == 4:
        return int(rng.integers(2049, 8193))
    return int(rng.integers(8193, 20_001))


def draw_case(seed: int, dtype: str) -> Case:
    rng = np.random.default_rng([seed, DTYPE_CODE[dtype]])
    s_q = int(rng.integers(5, 9)) if rng.random() < 0.1 else int(rng.integers(1, 5))
    h_kv = 2 if rng.random() < 0.25 else 1
    heads_per_kv = int(rng.choice([g for g in HEADS_PER_KV if g * h_kv <= 128]))
    low, high = [(1, 5), (5, 17), (17, 65), (65, 161)][rng.choice(4, p=[0.3, 0.4, 0.25, 0.05])]
    batch = int(rng.integers(low, high))
    seqlens = np.array([draw_seqlen(rng) for _ in range(batch)], dtype=np.int64)
    if rng.random() < 0.1:
        seqlens[:] = seqlens[0]                                     # one length for the whole batch
    if rng.random() < 0.25:
        seqlens[rng.integers(batch)] = rng.integers(8_000, 20_001)  # one long request: split over parts
    # Budgets: drop requests from the end (at least one stays; one request is always within them).
    rows = s_q * heads_per_kv * h_kv
    while len(seqlens) > 1 and (seqlens.sum() > MAX_TOKENS or rows * seqlens.sum() > MAX_ROW_TOKENS):
        seqlens = seqlens[:-1]
    causal = bool(rng.random() < 0.5)
    softmax_scale = float(np.exp(rng.uniform(np.log(0.02), np.log(0.2)))) if rng.random() < 0.15 else None
    spare_blocks = int(rng.integers(0, 9))
    if seqlens.sum() == 0:
        spare_blocks = max(spare_blocks, 1)                         # k_cache needs at least one block
    garbage_columns = int(rng.integers(0, 4))
    again = bool(rng.random() < 0.1)
    page_size = PAGE if rng.random() < 0.5 else int(rng.choice([1, 2, 4, 8, 16, 32, 128, 256, 512]))
    return Case(seed, dtype, seqlens.astype(np.int32), s_q, heads_per_kv * h_kv, h_kv, causal,
                softmax_scale, spare_blocks, garbage_columns, again, page_size)


def has_split_request(case: Case) -> bool:
    """Whether the scheduler (host model) splits some request of this shape: the combine path."""
    sm_count = driver.device_properties(cupy.cuda.runtime.getDevice())["sm_count"]
    parts = scheduler.num_sm_parts(sm_count, case.q_rows, case.h_kv)
    _, num_splits = scheduler.schedule(case.seqlens, parts)
    return bool((np.diff(num_splits) > 1).any())


def run_case(case: Case) -> None:
    """Raises AssertionError (with the call it concerns) if the kernel disagrees with the reference."""
    rng = np.random.default_rng([case.seed, DTYPE_CODE[case.dtype], 1])
    kept = []
    for call in range(2 if case.again else 1):
        inp = make_inputs(rng, case.seqlens, case.s_q, case.h_q, case.h_kv, case.dtype,
                          spare_blocks=case.spare_blocks, garbage_columns=case.garbage_columns,
                          page_size=case.page_size)
        kept.append(inp)          # the first call's arrays stay alive: the second gets new addresses
        out, lse = run_kernel(inp, case.causal, case.softmax_scale)
        try:
            check_against_reference(inp, out, lse, case.causal, case.dtype, case.softmax_scale)
        except AssertionError as e:
            which = "second call (cached plan, fresh arrays)" if call else "call"
            raise AssertionError(f"{which}: {e}") from None


def release_gpu_memory() -> None:
    """Drop the cached call plans (each keeps its first call's arrays and a workspace alive) and
    give the memory pool's free blocks back, so that memory stays flat over many shapes."""
    plans = getattr(mla, "_plans", None)
    if plans is not None:
        plans.clear()
    cupy.get_default_memory_pool().free_all_blocks()


def _setting(option, env: str, default):
    if option is not None:
        return int(option)
    value = os.environ.get(env, "").strip()
    return int(value) if value else default


@pytest.fixture(scope="module")
def fuzz_seed(request) -> int:
    """The master seed of this session: --fuzz-seed, $FLASHMLA_CUPY_FUZZ_SEED, or random."""
    seed = _setting(request.config.getoption("--fuzz-seed"), "FLASHMLA_CUPY_FUZZ_SEED", None)
    return seed if seed is not None else int.from_bytes(os.urandom(4), "little")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fuzz(dtype, fuzz_seed, request):
    shapes = _setting(request.config.getoption("--fuzz-shapes"), "FLASHMLA_CUPY_FUZZ_SHAPES", DEFAULT_SHAPES)
    assert shapes >= 1, f"--fuzz-shapes must be >= 1; got {shapes}"
    print(f"\nfuzz {dtype}: master seed {fuzz_seed} ({shapes} shapes, seeds {fuzz_seed}..{fuzz_seed + shapes - 1})",
          flush=True)
    start = time.perf_counter()
    failures: list[str] = []
    stats = {"split": 0, "causal": 0, "h_kv=2": 0, "s_q>4": 0, "scale": 0, "again": 0, "empty request": 0}
    done = 0
    for i in range(shapes):
        case = draw_case(fuzz_seed + i, dtype)
        stats["split"] += has_split_request(case)
        stats["causal"] += case.causal and case.s_q > 1
        stats["h_kv=2"] += case.h_kv == 2
        stats["s_q>4"] += case.s_q > 4
        stats["scale"] += case.softmax_scale is not None
        stats["again"] += case.again
        stats["empty request"] += bool((case.seqlens == 0).any())
        try:
            run_case(case)
        except AssertionError as e:
            failures.append(f"[shape {i}] {case.describe()}\n    {e}\n    replay: {case.replay()}")
        except FATAL_ERRORS as e:
            failures.append(f"[shape {i}] {case.describe()}\n    {type(e).__name__}: {e}\n    replay: {case.replay()}\n"
                            f"    CUDA error: the remaining {shapes - i - 1} shapes were not run")
            done += 1
            break
        except Exception as e:    # e.g. out of memory, a rejected argument: report, go on
            failures.append(f"[shape {i}] {case.describe()}\n    {type(e).__name__}: {e}\n    replay: {case.replay()}")
        finally:
            try:
                release_gpu_memory()
            except Exception:     # after a CUDA error freeing may fail too; the loop stops anyway
                pass
        done += 1
        if shapes >= 200 and done % 100 == 0:
            print(f"  {done}/{shapes} shapes, {len(failures)} failed, {time.perf_counter() - start:.0f} s",
                  flush=True)

    elapsed = time.perf_counter() - start
    coverage = ", ".join(f"{v} {k}" for k, v in stats.items())
    print(f"fuzz {dtype}: master seed {fuzz_seed}: {done} shapes in {elapsed:.1f} s, {len(failures)} failed "
          f"({coverage})", flush=True)
    sys.stdout.flush()
    if failures:
        shown = failures[:MAX_REPORTED]
        more = f"\n... and {len(failures) - MAX_REPORTED} more" if len(failures) > MAX_REPORTED else ""
        pytest.fail(f"{len(failures)} of {done} fuzz shapes failed ({dtype}, master seed {fuzz_seed}):\n"
                    + "\n".join(shown) + more, pytrace=False)
