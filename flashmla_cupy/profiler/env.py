"""Device and version facts (for the profile header, ``info`` and the JSON export).

Every probe is guarded: on a machine without a GPU (or without a driver) the device part says so
and the version part still fills in.
"""
from __future__ import annotations

import importlib.metadata
import platform
import sys

from .nvml import MEM, SM, Nvml


class NoGPU(RuntimeError):
    """No usable CUDA device; the message is one line, fit for the command line."""


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return f"{type(e).__name__}: {s.splitlines()[0]}" if s else type(e).__name__


def gpu_count() -> int:
    """Number of CUDA devices; ``NoGPU`` (one-line reason) when there is no driver or device."""
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no libcuda, insufficient driver, CUDA error ...
        # CUDA says "driver version is insufficient" also where no driver is installed at all
        from ..versions import driver_problem
        raise NoGPU(f"no CUDA GPU available ({driver_problem() or _first_line(e)})") from None
    if n <= 0:
        raise NoGPU("no CUDA GPU available (0 devices)")
    return n


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_version() -> str:
    v = _version("flashmla-cupy")
    if v:
        return v
    try:  # source checkout that was never installed
        import tomllib
        from pathlib import Path
        root = Path(__file__).resolve().parents[2]
        return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"] + " (source)"
    except Exception:  # noqa: BLE001
        return "unknown"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}" if v > 0 else "none"


def versions() -> dict:
    """Versions of everything the toolkit runs on (``None`` where absent)."""
    out: dict = {
        "flashmla-cupy": package_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import cupy
        out["cupy"] = cupy.__version__
    except Exception as e:  # noqa: BLE001
        out["cupy"] = f"unavailable ({_first_line(e)})"
    try:
        from cupy_backends.cuda.libs import nvrtc
        out["nvrtc"] = "%d.%d" % nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001
        out["nvrtc"] = f"unavailable ({_first_line(e)})"
    from ..versions import driver_cuda_version
    v = driver_cuda_version()
    out["cuda_driver"] = _cuda_version(v) if v else "none (no NVIDIA driver: libcuda.so.1 not found)"
    try:
        import cupy
        out["cuda_runtime"] = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
    except Exception as e:  # noqa: BLE001
        out["cuda_runtime"] = f"unavailable ({_first_line(e)})"
    out["nvidia_driver"] = _nvml_driver()
    out["cuda-bindings"] = _version("cuda-bindings") or _version("cuda-python")
    try:
        from .. import compiler
        out["cutlass"] = compiler.toolchain()["cutlass"]
        out["cutlass_include"] = str(compiler.cutlass_include_dir())
    except Exception as e:  # noqa: BLE001
        out["cutlass"] = f"unavailable ({_first_line(e)})"
    for name in ("numpy", "ml_dtypes", "rich", "matplotlib"):
        out[name] = _version(name.replace("_", "-")) or _version(name)
    from .ceilings import cublas_status
    why = cublas_status()
    out["cublas"] = "available" if why is None else why
    return out


def _nvml_driver() -> str | None:
    try:
        with Nvml() as n:
            return n.driver_version()
    except Exception:  # noqa: BLE001 - NVML is optional
        return None


def _nvml_clocks(pci_bus_id: str) -> dict:
    """Current and maximum SM / memory clocks in MHz from NVML, where it is available."""
    try:
        with Nvml() as n:
            h = n.handle(pci_bus_id)
            return {"sm_clock_mhz": n.clock(h, SM), "sm_clock_max_mhz": n.max_clock(h, SM),
                    "mem_clock_mhz": n.clock(h, MEM), "mem_clock_max_mhz": n.max_clock(h, MEM)}
    except Exception:  # noqa: BLE001
        return {}


def device_info(device_id: int = 0) -> dict:
    """Name, compute capability, SMs, memory, L2, clocks of one device (requires a GPU)."""
    import cupy

    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(device_id)
    name = props["name"]

    def attr(a, default=0):
        try:
            return int(rt.deviceGetAttribute(a, device_id))
        except Exception:  # noqa: BLE001
            return default

    info = {
        "id": device_id,
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "arch": f"sm_{props['major']}{props['minor']}" + ("a" if props["major"] == 9 else ""),
        "sm_count": int(props["multiProcessorCount"]),
        "memory_bytes": int(props.get("totalGlobalMem", 0)),
        "l2_bytes": attr(rt.cudaDevAttrL2CacheSize, int(props.get("l2CacheSize", 0))),
        "sm_clock_max_mhz": attr(rt.cudaDevAttrClockRate) // 1000 or None,
        "mem_clock_max_mhz": attr(rt.cudaDevAttrMemoryClockRate) // 1000 or None,
        "memory_bus_bits": attr(rt.cudaDevAttrGlobalMemoryBusWidth) or None,
    }
    info.update(_nvml_clocks(cupy.cuda.Device(device_id).pci_bus_id))
    try:
        free, total = rt.memGetInfo()
        info["memory_free_bytes"] = int(free)
    except Exception:  # noqa: BLE001
        pass
    return info


def pdl_state() -> str:
    """How the MLA call launches its kernels: always with Programmatic Dependent Launch (the
    split-KV kernel, sparse or dense, after the previous kernel in the stream; the combine kernel
    after it). Reported so that timings say so; there is no switch."""
    return "on"


def bf16_status() -> str | None:
    """``None`` if ``ml_dtypes.bfloat16`` is importable and CuPy accepts it as a dtype."""
    try:
        import ml_dtypes
    except ImportError as e:
        return f"ml_dtypes missing ({e})"
    try:
        import cupy
        cupy.dtype(ml_dtypes.bfloat16)
    except Exception as e:  # noqa: BLE001
        return f"CuPy rejects ml_dtypes.bfloat16 ({_first_line(e)})"
    return None


def environment(device_id: int | None = 0) -> dict:
    env = {"versions": versions(), "argv": sys.argv[1:]}
    if device_id is not None:
        try:
            env["gpu"] = device_info(device_id)
        except Exception as e:  # noqa: BLE001
            env["gpu"] = {"error": _first_line(e)}
    env["pdl"] = pdl_state()
    return env
