"""Loaded kernels per device and their launches through ``cuLaunchKernelEx``.

CuPy loads the cubin (``cupy.cuda.function.Module``) and owns streams; cuda-python's driver
bindings set function attributes and launch with Programmatic Dependent Launch, which CuPy's own
launcher cannot express. Every kernel of the package takes a single parameter (its params struct)
so a launch is: grid, block, dynamic shared memory, stream, the struct's bytes.

Launch configurations are built once per (grid, block, shared memory, stream, PDL) and reused:
the per-call Python work is one driver call plus a copy of the parameter bytes.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import cupy

from . import compiler
from .compiler import Program


class DriverError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _driver():
    from cuda.bindings import driver
    return driver


def check(result):
    """Unpack a cuda-bindings result tuple, raising on an error code."""
    drv = _driver()
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
    p = device_properties(device_id)
    return f"sm_{p['major']}{p['minor']}" + ("a" if p["major"] == 9 else "")


class Kernel:
    """One ``__global__`` function of a compiled program, loaded on one device."""

    def __init__(self, program: Program, name_expression: str, device_id: int, arch: str):
        self.program = program
        self.name = name_expression
        self.device_id = device_id
        self.cubin = compiler.build(program, arch)
        with cupy.cuda.Device(device_id):
            self._module = cupy.cuda.function.Module()
            self._module.load(self.cubin.image)
            self._function = self._module.get_function(self.cubin.lowered[name_expression])
        drv = _driver()
        self.handle = drv.CUfunction(self._function.ptr)
        self._smem_limit = 0
        self._configs: dict[tuple, object] = {}
        self._lock = threading.Lock()

    @property
    def resources(self) -> compiler.KernelResources:
        return self.cubin.resources.get(self.name, compiler.KernelResources())

    def _config(self, grid, block, smem: int, stream: int, pdl: bool):
        key = (grid, block, smem, stream, pdl)
        cfg = self._configs.get(key)
        if cfg is not None:
            return cfg
        drv = _driver()
        with self._lock:
            if smem > self._smem_limit and smem > 48 * 1024:
                check(drv.cuFuncSetAttribute(
                    self.handle, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
                self._smem_limit = smem
            cfg = drv.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
            cfg.sharedMemBytes = smem
            cfg.hStream = drv.CUstream(stream)
            if pdl:
                attr = drv.CUlaunchAttribute()
                attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                attr.value.programmaticStreamSerializationAllowed = 1
                cfg.attrs = [attr]
                cfg.numAttrs = 1
            else:
                cfg.numAttrs = 0
            if len(self._configs) > 256:
                self._configs.clear()
            self._configs[key] = cfg
        return cfg

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], params: bytes | bytearray,
               smem: int = 0, stream: int | None = None, pdl: bool = False) -> None:
        """Launch with the parameter struct's bytes (``params.as_bytes``) as the only argument.

        ``stream`` defaults to CuPy's current stream; ``pdl`` lets the kernel start while the
        previous one in the stream finishes (the kernel must wait with griddepcontrol.wait).
        """
        if stream is None:
            stream = cupy.cuda.get_current_stream().ptr
        cfg = self._config(grid, block, smem, stream, pdl)
        arg = (ctypes.c_char * len(params)).from_buffer(params) if isinstance(params, bytearray) \
            else ctypes.create_string_buffer(bytes(params), len(params))
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
        check(_driver().cuLaunchKernelEx(cfg, self.handle, ctypes.addressof(argv), 0))


_kernels: dict[tuple, Kernel] = {}
_kernels_lock = threading.Lock()


def get_kernel(program: Program, name_expression: str, device_id: int | None = None,
               arch: str | None = None) -> Kernel:
    """The loaded kernel on ``device_id`` (default: CuPy's current device), compiled on first use."""
    if device_id is None:
        device_id = cupy.cuda.runtime.getDevice()
    if arch is None:
        arch = device_arch(device_id)
    key = (program, name_expression, device_id, arch)
    kernel = _kernels.get(key)
    if kernel is None:
        with _kernels_lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = Kernel(program, name_expression, device_id, arch)
                _kernels[key] = kernel
    return kernel
