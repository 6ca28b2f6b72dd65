"""CUDA driver helpers, in one place: the cuda-python bindings, error checks, device facts, the
raw ``cuLaunchKernelEx`` entry point and stream-capture queries.

CuPy owns devices, streams, memory and module loading; what CuPy does not expose (tensor maps,
function attributes, launch attributes such as PDL, capture modes) goes through cuda-python's
``cuda.bindings.driver`` — or, on the per-call path, straight through ctypes.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import sys

import cupy


class DriverError(RuntimeError):
    """A CUDA driver call failed."""


@functools.lru_cache(maxsize=None)
def driver():
    """``cuda.bindings.driver`` (imported on first use)."""
    from cuda.bindings import driver as drv
    return drv


def check(result):
    """Unpack a cuda-bindings result tuple, raising ``DriverError`` on an error code."""
    drv = driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, msg = drv.cuGetErrorString(err)
        raise DriverError(f"CUDA driver error {int(err)}: {msg.decode() if msg else err}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


@functools.lru_cache(maxsize=None)
def device_properties(device_id: int) -> dict:
    """Name, compute capability, SM count and clocks of a device (cached)."""
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"]
    return {
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "major": int(props["major"]),
        "minor": int(props["minor"]),
        "sm_count": int(props["multiProcessorCount"]),
        "clock_khz": int(props.get("clockRate", 0)),
        "memory_clock_khz": int(props.get("memoryClockRate", 0)),
        "smem_per_block_optin": int(props.get("sharedMemPerBlockOptin", 0)),
    }


def device_arch(device_id: int) -> str:
    """The NVRTC target of a device: ``sm_90a`` on Hopper (WGMMA, TMA), ``sm_XY`` elsewhere."""
    p = device_properties(device_id)
    return f"sm_{p['major']}{p['minor']}" + ("a" if p["major"] == 9 else "")


@functools.lru_cache(maxsize=None)
def libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")


def is_capturing(stream_ptr: int) -> bool:
    """Whether ``stream_ptr`` is capturing a CUDA graph (a cheap query, no synchronization)."""
    status = ctypes.c_int()
    fn = libcuda().cuStreamIsCapturing
    err = fn(ctypes.c_void_p(stream_ptr), ctypes.byref(status))
    if err:
        check(driver().CUresult(err))
    return status.value != 0     # CU_STREAM_CAPTURE_STATUS_NONE = 0


@contextlib.contextmanager
def relaxed_capture_mode():
    """Let this thread make calls that a global-mode stream capture forbids (such as
    allocating pinned memory) while some stream may be capturing."""
    mode = ctypes.c_int(2)       # CU_STREAM_CAPTURE_MODE_RELAXED
    fn = libcuda().cuThreadExchangeStreamCaptureMode
    err = fn(ctypes.byref(mode))
    if err:
        check(driver().CUresult(err))
    try:
        yield
    finally:
        fn(ctypes.byref(mode))
