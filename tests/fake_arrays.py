"""CuPy arrays and GPUs that argument checks can be tested with on a machine without a GPU.

``fake_array`` builds a CuPy array header over a made-up device address: the checks read only
its shape, dtype, strides, address and device, so it is never dereferenced. ``H100`` and
``A100`` are what ``flashmla_cupy.driver.device_properties`` reports for those GPUs. The host
objects stand for foreign arrays in host memory that speak the GPU array protocols.
"""
from __future__ import annotations

import cupy
import numpy as np

FAKE_ADDRESS = 0x7F00_0000_0000      # 256-byte aligned, like CuPy's allocations
FAKE_SPAN = 1 << 40                  # fake arrays lie in [FAKE_ADDRESS, FAKE_ADDRESS + FAKE_SPAN)

H100 = {"name": "NVIDIA H100 80GB HBM3", "major": 9, "minor": 0, "sm_count": 132, "clock_khz": 1980000,
        "memory_clock_khz": 2619000, "smem_per_block_optin": 232448}
A100 = {"name": "NVIDIA A100-SXM4-80GB", "major": 8, "minor": 0, "sm_count": 108, "clock_khz": 1410000,
        "memory_clock_khz": 1593000, "smem_per_block_optin": 166912}


def fake_array(shape, dtype=np.float32, *, step: int = 1, offset: int = 0, device: int = 0) -> cupy.ndarray:
    """A CuPy array header of ``shape`` on ``device``: C order, except that consecutive elements
    of the last axis are ``step`` apart; it starts ``offset`` elements past an aligned address."""
    shape = tuple(shape)
    itemsize = np.dtype(dtype).itemsize
    strides, size = [], itemsize * step
    for n in reversed(shape):
        strides.insert(0, size)
        size *= n
    memory = cupy.cuda.UnownedMemory(FAKE_ADDRESS, max(1, size + offset * itemsize), None, device_id=device)
    pointer = cupy.cuda.MemoryPointer(memory, offset * itemsize)
    return cupy.ndarray(shape, dtype, memptr=pointer, strides=tuple(strides))


class HostDLPack:
    """An array in host memory that speaks DLPack: device type 1 (kDLCPU) or 3 (kDLCUDAHost,
    pinned host memory)."""

    def __init__(self, device_type: int = 1):
        self.device_type = device_type

    def __dlpack__(self, stream=None, **kwargs):
        raise AssertionError("host memory must be refused before it is exported")

    def __dlpack_device__(self):
        return (self.device_type, 0)


class HostCudaArrayInterface:
    """A ``__cuda_array_interface__`` that points at a NumPy array's host memory."""

    def __init__(self, shape=(2, 3), dtype=np.int32):
        self.host = np.zeros(shape, dtype)
        self.__cuda_array_interface__ = {"shape": self.host.shape, "typestr": self.host.dtype.str,
                                         "data": (self.host.ctypes.data, False), "version": 3}
