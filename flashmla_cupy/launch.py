"""Loaded kernels per device and their launches through ``cuLaunchKernelEx``.

CuPy loads the cubin (``cupy.cuda.function.Module``) and owns streams; cuda-python's driver
bindings set function attributes and report errors. Launches go straight to the driver's
``cuLaunchKernelEx`` with a prebuilt ``CUlaunchConfig`` (and its Programmatic Dependent Launch
attribute), which CuPy's own launcher cannot express and cuda-python's generic wrapper would
rebuild on every call. Every kernel of the package takes a single parameter, its params struct.

Hot paths build a ``Launch`` once (``Kernel.prepare``) and then only update fields of its
parameter struct and call it: one ctypes call into the driver per launch.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import cupy

from . import compiler
from .compiler import Program
from .driver import check, device_arch, driver, libcuda
from .params import device_sizeof


class Kernel:
    """One ``__global__`` function of a compiled program, loaded on one device."""

    def __init__(self, program: Program, name_expression: str, device_id: int, arch: str):
        self.program = program
        self.name = name_expression
        self.device_id = device_id
        self.cubin = compiler.build(program, arch)
        with cupy.cuda.Device(device_id):
            self._module = cupy.cuda.function.Module()
            try:
                self._module.load(self.cubin.image)
            except cupy.cuda.driver.CUDADriverError:
                if not self.cubin.bundled:
                    raise
                # the driver refuses the cubin shipped in the wheel: compile with NVRTC instead
                self.cubin = compiler.build(program, arch, bundled=False)
                self._module.load(self.cubin.image)
            self._function = self._module.get_function(self.cubin.lowered[name_expression])
        self.handle = driver().CUfunction(self._function.ptr)
        self._smem_limit = 0
        self._lock = threading.Lock()

    @property
    def resources(self) -> compiler.KernelResources:
        return self.cubin.resources.get(self.name, compiler.KernelResources())

    def _ensure_smem(self, smem: int) -> None:
        if smem > 48 * 1024 and smem > self._smem_limit:
            drv = driver()
            with self._lock:
                check(drv.cuFuncSetAttribute(
                    self.handle, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
                self._smem_limit = smem

    def prepare(self, grid: tuple[int, int, int], block: tuple[int, int, int], params_type,
                smem: int = 0, stream: int | None = None, pdl: bool = False, cluster_x: int = 1) -> "Launch":
        """A reusable launch of this kernel with a parameter struct of ``params_type`` (a ctypes
        struct type, or a size in bytes for an opaque parameter).

        ``stream`` defaults to CuPy's current stream; ``pdl`` lets the kernel start while the
        previous one in the stream finishes (the kernel must wait with griddepcontrol.wait);
        ``cluster_x`` > 1 groups that many consecutive CTAs along x into a cluster.
        """
        if grid[0] % cluster_x:
            raise ValueError(f"grid x ({grid[0]}) must be a multiple of the cluster size ({cluster_x})")
        self._ensure_smem(smem)
        if stream is None:
            stream = cupy.cuda.get_current_stream().ptr
        return Launch(self, grid, block, smem, stream, pdl, params_type, cluster_x)

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int],
               params: ctypes.Structure | bytes, smem: int = 0, stream: int | None = None,
               pdl: bool = False) -> None:
        """One-off launch with ``params``: a ctypes struct mirroring the kernel's parameter, or
        its bytes."""
        raw = bytes(params)
        run = self.prepare(grid, block, len(raw) if isinstance(params, (bytes, bytearray))
                           else type(params), smem, stream, pdl)
        ctypes.memmove(run.params_address, raw, len(raw))
        run()


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""
    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint),
    ]


@functools.lru_cache(maxsize=None)
def _cu_launch_kernel_ex():
    fn = libcuda().cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class Launch:
    """A prepared launch: grid, block, shared memory, stream, PDL and cluster fixed; ``params`` (a
    ctypes struct living in a buffer of the kernel parameter's device size) is updated between
    calls."""

    def __init__(self, kernel: Kernel, grid, block, smem: int, stream: int, pdl: bool, params_type,
                 cluster_x: int = 1):
        self.kernel = kernel
        if isinstance(params_type, int):
            self.buffer = (ctypes.c_ubyte * params_type)()
            self.params = None
        else:
            self.buffer = (ctypes.c_ubyte * device_sizeof(params_type))()
            self.params = params_type.from_buffer(self.buffer)
        self.params_address = ctypes.addressof(self.buffer)
        self._argv = (ctypes.c_void_p * 1)(self.params_address)
        ids = driver().CUlaunchAttributeID
        attrs = []
        if pdl:
            attrs.append((ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, (1,)))  # allowed
        if cluster_x > 1:
            attrs.append((ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, (cluster_x, 1, 1)))
        self._attrs = (_LaunchAttribute * max(len(attrs), 1))()
        for slot, (attr_id, values) in zip(self._attrs, attrs):
            slot.id = int(attr_id)
            (ctypes.c_uint * len(values)).from_buffer(slot.value)[:] = values
        cfg = _LaunchConfig(*grid, *block, smem, stream)
        if attrs:
            cfg.attrs = ctypes.cast(self._attrs, ctypes.POINTER(_LaunchAttribute))
            cfg.numAttrs = len(attrs)
        self._config = cfg
        self._launch = _cu_launch_kernel_ex()
        self._handle = int(kernel._function.ptr)

    def __call__(self) -> None:
        err = self._launch(self._config, self._handle, self._argv, None)
        if err:
            check(driver().CUresult(err))


_kernels: dict[tuple, Kernel] = {}
_kernels_lock = threading.Lock()


def get_kernel(program: Program, name_expression: str | None = None, device_id: int | None = None,
               arch: str | None = None) -> Kernel:
    """The loaded kernel ``name_expression`` (default: the program's first) on ``device_id``
    (default: CuPy's current device), compiled on first use."""
    if name_expression is None:
        name_expression = program.kernels[0]
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
