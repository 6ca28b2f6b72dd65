"""Shared test setup: GPU tests skip, with the reason, where no suitable GPU is present.

Markers: ``gpu`` (any CUDA GPU), ``hopper`` (an sm_90 GPU: the MLA kernels), ``nvrtc`` (NVRTC
and the headers it compiles with), ``slow`` (long checks, run with ``-m slow`` or ``--run-slow``).

Fixture ``rng``: a NumPy generator on a fresh seed, printed (pytest shows it on failure);
``FLASHMLA_CUPY_TEST_SEED`` replays one.

Fuzzing options (tests/test_fuzz.py): ``--fuzz-shapes N`` shapes per dtype (default: environment
variable ``FLASHMLA_CUPY_FUZZ_SHAPES``, else 40) and ``--fuzz-seed S`` master seed (default:
``FLASHMLA_CUPY_FUZZ_SEED``, else random; printed, and in every failure message).
"""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest

# FlashMLA's own test script (torch and triton at import): run by test_flash_mla_torch.py in a
# subprocess, never collected itself.
collect_ignore = ["seed_flash_mla.py"]


@pytest.fixture
def rng():
    seed = int(os.environ.get("FLASHMLA_CUPY_TEST_SEED", np.random.SeedSequence().entropy))
    print(f"seed: FLASHMLA_CUPY_TEST_SEED={seed}")
    return np.random.default_rng(seed)


@functools.lru_cache(maxsize=None)
def gpu_skip_reason() -> str | None:
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no libcuda, CUDA error ...
        return f"no CUDA GPU here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unavailable'})"
    return None if count > 0 else "no CUDA GPU here (0 devices)"


@functools.lru_cache(maxsize=None)
def hopper_skip_reason() -> str | None:
    reason = gpu_skip_reason()
    if reason:
        return reason
    from flashmla_cupy.driver import device_properties
    props = device_properties(0)
    if props["major"] != 9:
        return f"needs a Hopper (sm_90) GPU; device 0 is {props['name']} (sm_{props['major']}{props['minor']})"
    return None


@functools.lru_cache(maxsize=None)
def nvrtc_skip_reason() -> str | None:
    from flashmla_cupy import compiler
    try:
        compiler._nvrtc().getVersion()
        compiler.include_dirs()
    except Exception as e:  # noqa: BLE001 -- any failure means: cannot compile here
        return f"NVRTC or headers unavailable: {type(e).__name__}: {e}"
    return None


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")
    group = parser.getgroup("flashmla-cupy fuzzing (tests/test_fuzz.py)")
    group.addoption("--fuzz-shapes", type=int, default=None, metavar="N",
                    help="random shapes per dtype (default: $FLASHMLA_CUPY_FUZZ_SHAPES or 40)")
    group.addoption("--fuzz-seed", type=int, default=None, metavar="S",
                    help="master seed; shape i uses seed S + i (default: $FLASHMLA_CUPY_FUZZ_SEED or random)")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--run-slow") or "slow" in (config.getoption("-m") or "")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --run-slow"))
        elif "hopper" in item.keywords and hopper_skip_reason():
            item.add_marker(pytest.mark.skip(reason=hopper_skip_reason()))
        elif "gpu" in item.keywords and gpu_skip_reason():
            item.add_marker(pytest.mark.skip(reason=gpu_skip_reason()))
        elif "nvrtc" in item.keywords and nvrtc_skip_reason():
            item.add_marker(pytest.mark.skip(reason=nvrtc_skip_reason()))
