"""The two roofs, measured in the same run, and which one bounds a shape.

* Device copy bandwidth: a 1 GiB device-to-device ``cudaMemcpyAsync``, counting bytes read plus
  bytes written (the same convention as the seed's "GB/s", which counts the KV cache read and the
  output written).
* Matrix throughput: an 8192³ product through cuBLAS (``cublasGemmEx``) in bf16 with float32
  accumulation, on random data; fp16 through ``cupy.matmul`` where bf16 cannot be had. The dtype
  and the path used are recorded in ``Ceilings.matmul_method``. The attention profile (float32
  kernels) measures a float32 product instead. The FP8 caches (sparse decoding, and dense with
  ``--dtype fp8``, read by bf16 or e4m3 q) are read in FP8 but multiplied in 16 bits, so bf16 is
  their roof too; there is no FP8 ceiling (``NO_FP8_MATMUL`` says why).

``classify`` is pure: it compares the time the bytes need at the copy ceiling with the time the
FLOPs need at the matmul ceiling, and reports the larger one as the bound.
"""
from __future__ import annotations

import contextlib
import ctypes
import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class Ceilings:
    copy_gbps: float | None = None          # GB/s (1e9), read + written
    matmul_tflops: float | None = None      # TFLOP/s (1e12)
    copy_method: str = ""
    matmul_method: str = ""
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Bound:
    kind: str                    # "memory", "compute" or "?" (no ceiling measured)
    t_memory_ms: float | None    # bytes / copy bandwidth
    t_compute_ms: float | None   # flops / matmul peak
    roof_fraction: float | None  # max(t_memory, t_compute) / measured time: 1.0 is on the roof


def classify(time_ms: float, flops: float, nbytes: float, ceilings: Ceilings) -> Bound:
    """Which roof bounds this work, and how close the measured time comes to it."""
    t_mem = nbytes / (ceilings.copy_gbps * 1e9) * 1e3 if ceilings.copy_gbps else None
    t_math = flops / (ceilings.matmul_tflops * 1e12) * 1e3 if ceilings.matmul_tflops else None
    if t_mem is None and t_math is None:
        return Bound("?", None, None, None)
    if t_math is None or (t_mem is not None and t_mem >= t_math):
        kind, floor = "memory", t_mem
    else:
        kind, floor = "compute", t_math
    frac = floor / time_ms if time_ms and time_ms > 0 else None
    return Bound(kind, t_mem, t_math, frac)


def fractions(gbps: float, tflops: float, ceilings: Ceilings) -> tuple[float | None, float | None]:
    """Achieved bandwidth and FLOP rate as fractions of the measured ceilings."""
    fb = gbps / ceilings.copy_gbps if ceilings.copy_gbps else None
    ff = tflops / ceilings.matmul_tflops if ceilings.matmul_tflops else None
    return fb, ff


# --------------------------------------------------------------------------------------------
# Measuring (GPU)
# --------------------------------------------------------------------------------------------

# Said with the ceilings of a profile over an FP8 cache (sparse, dense fp8). cublasGemmEx refuses
# FP8 operands; cuBLASLt's cublasLtMatmul takes them, but CuPy binds no cuBLASLt function.
NO_FP8_MATMUL = ("no FP8 matmul ceiling: FP8 (e4m3) products need cuBLASLt, which CuPy does not bind; the FP8 "
                 "kernels dequantize the FP8 cache and multiply in 16 bits (with an e4m3 q, QK^T and P·V "
                 "in FP8), and are measured against the bf16 ceiling")

CUDA_R_16F = 2
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N = 0
CUBLAS_POINTER_MODE_HOST = 0


def cublas_status() -> str | None:
    """``None`` if cuBLAS loads, else why not (the matmul ceiling and CuPy baseline need it)."""
    try:
        from cupy_backends.cuda.libs import cublas
        cublas.create  # noqa: B018 - attribute access loads the library
    except Exception as e:  # noqa: BLE001
        first = (str(e).splitlines()[0] if str(e) else type(e).__name__).split(": No such file")[0]
        from ..versions import install_command
        return f"cuBLAS not found ({first}): {install_command('profile')}"
    return None


def measure_copy(stream, nbytes: int = 1 << 30, repeats: int = 20, warmup: int = 3) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read + written."""
    import cupy

    from .timing import time_event_region

    src = cupy.empty(nbytes, dtype=cupy.uint8)
    dst = cupy.empty(nbytes, dtype=cupy.uint8)
    cupy.cuda.runtime.memsetAsync(src.data.ptr, 1, nbytes, stream.ptr)
    kind = cupy.cuda.runtime.memcpyDeviceToDevice

    def copy():
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, kind, stream.ptr)

    ms = statistics.median(time_event_region(copy, stream=stream, repeats=repeats, warmup=warmup))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _random_half_bits(cupy, shape, bf16: bool, seed: int):
    """Random normal values as uint16 bit patterns of bf16 (round to nearest even) or fp16."""
    x = cupy.random.RandomState(seed).standard_normal(shape, dtype=cupy.float32)
    if not bf16:
        return x.astype(cupy.float16).view(cupy.uint16)
    u = x.view(cupy.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16)


def _gemm_ex(n: int, dtype_code: int, stream, repeats: int, warmup: int) -> float:
    import cupy
    from cupy_backends.cuda.libs import cublas

    from .timing import time_event_region

    a = _random_half_bits(cupy, (n, n), dtype_code == CUDA_R_16BF, 1)
    b = _random_half_bits(cupy, (n, n), dtype_code == CUDA_R_16BF, 2)
    c = cupy.empty((n, n), dtype=cupy.uint16)
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    handle = cupy.cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
    try:
        def gemm():
            cublas.setStream(handle, stream.ptr)
            cublas.gemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n,
                          ctypes.addressof(alpha), a.data.ptr, dtype_code, n,
                          b.data.ptr, dtype_code, n,
                          ctypes.addressof(beta), c.data.ptr, dtype_code, n,
                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        ms = statistics.median(time_event_region(gemm, stream=stream, repeats=repeats, warmup=warmup))
    finally:
        cublas.setPointerMode(handle, mode)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def _matmul_fp16(n: int, stream, repeats: int, warmup: int) -> float:
    import cupy

    from .timing import time_event_region

    a = _random_half_bits(cupy, (n, n), False, 1).view(cupy.float16)
    b = _random_half_bits(cupy, (n, n), False, 2).view(cupy.float16)
    c = cupy.empty((n, n), dtype=cupy.float16)
    ms = statistics.median(time_event_region(lambda: cupy.matmul(a, b, out=c), stream=stream,
                                             repeats=repeats, warmup=warmup))
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def _matmul_fp32(n: int, stream, repeats: int, warmup: int) -> float:
    import cupy

    from .timing import time_event_region

    gen = cupy.random.RandomState(1)
    a = gen.standard_normal((n, n), dtype=cupy.float32)
    b = gen.standard_normal((n, n), dtype=cupy.float32)
    c = cupy.empty((n, n), dtype=cupy.float32)
    ms = statistics.median(time_event_region(lambda: cupy.matmul(a, b, out=c), stream=stream,
                                             repeats=repeats, warmup=warmup))
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def measure_matmul(stream, n: int = 8192, repeats: int = 20, warmup: int = 3,
                   dtype: str = "bf16") -> tuple[float, str]:
    """(TFLOP/s, how): bf16 cublasGemmEx, else fp16 cupy.matmul (both float32 accumulation);
    ``dtype="fp32"``: float32 cupy.matmul (the roof of float32 attention kernels)."""
    if dtype == "fp32":
        import os
        tf32 = os.environ.get("CUPY_TF32", "0") not in ("", "0")
        return _matmul_fp32(n, stream, max(repeats // 4, 3), 1), \
            f"cupy.matmul fp32 {n}³ ({'TF32 on: CUPY_TF32 set' if tf32 else 'no TF32'}), random data"
    errors = []
    try:
        return _gemm_ex(n, CUDA_R_16BF, stream, repeats, warmup), \
            f"cuBLAS GemmEx bf16 {n}³, fp32 accumulate, random data"
    except Exception as e:  # noqa: BLE001
        errors.append(f"bf16 GemmEx: {type(e).__name__}: {e}")
    try:
        return _matmul_fp16(n, stream, repeats, warmup), \
            f"cupy.matmul fp16 {n}³ (bf16 unavailable: {errors[0]})"
    except Exception as e:  # noqa: BLE001
        errors.append(f"fp16 matmul: {type(e).__name__}: {e}")
    raise RuntimeError("; ".join(errors))


def measure(stream, *, copy_bytes: int = 1 << 30, matmul_n: int = 8192, matmul_dtype: str = "bf16",
            during_matmul=None) -> Ceilings:
    """Both ceilings; a failure leaves that ceiling ``None`` with the reason in ``notes``.
    ``during_matmul``: a context (the clock sampler's) held around the matmul's runs."""
    import cupy

    c = Ceilings()
    try:
        c.copy_gbps = measure_copy(stream, copy_bytes)
        c.copy_method = f"cudaMemcpyAsync device→device, {copy_bytes / 2**30:.0f} GiB, read + write"
    except Exception as e:  # noqa: BLE001
        c.notes.append(f"copy ceiling not measured: {type(e).__name__}: {e}")
    why = cublas_status()
    if why:
        c.notes.append(f"matmul ceiling not measured: {why}")
    else:
        try:
            with during_matmul or contextlib.nullcontext():
                c.matmul_tflops, c.matmul_method = measure_matmul(stream, matmul_n, dtype=matmul_dtype)
        except Exception as e:  # noqa: BLE001
            c.notes.append(f"matmul ceiling not measured: {e}")
    cupy.get_default_memory_pool().free_all_blocks()
    return c
