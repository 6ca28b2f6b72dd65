"""What flashmla-cupy runs on: the oldest supported versions, the CUDA majors and their drivers,
and the check that ``import flashmla_cupy`` makes before anything else.

``MINIMUM`` holds pyproject.toml's lower bounds; CI installs exactly these versions
(``.ci/oldest.txt``) and runs the CPU tests on them, and ``tests/test_install.py`` keeps the three
in step. A dependency that is missing or older than its bound, or two CuPy packages side by side,
stop the import with one line that says what to install (``UnsupportedEnvironment``), instead of
an error deep inside CuPy or NVRTC on first use.

Everything here reads package metadata and the driver's version only: no CUDA call, no import of
CuPy, so the check is cheap and works on machines without a GPU.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import re
import sys

# distribution -> oldest supported version (pyproject.toml's lower bounds)
MINIMUM = {
    "numpy": "2.0",              # CuPy 14 needs NumPy 2
    "ml_dtypes": "0.4",          # 0.3 does not import under NumPy 2
    "rich": "13.0",
    "cupy": "14.0.1",            # 13.x does not find the NVRTC wheels; 14.0.0 rejects bfloat16 arrays
    "cuda-bindings": "12.8",
}

# CuPy's wheels, one per CUDA major; "cupy" is a source or conda build (any major)
CUPY_PACKAGES = {"cupy-cuda12x": 12, "cupy-cuda13x": 13, "cupy-cuda11x": 11, "cupy": None}
SUPPORTED_CUDA = (12, 13)

# The oldest Linux driver of each CUDA major (what CuPy's wheel of that major needs). The cubins
# a wheel ships come from NVRTC 12 so that drivers of both majors load them.
MIN_DRIVER = {12: "525.60.13", 13: "580.65.06"}

INSTALL_HINT = ("pip install 'flashmla-cupy[cu12]' (CUDA 12, driver >= 525.60.13) "
                "or 'flashmla-cupy[cu13]' (CUDA 13, driver >= 580.65.06)")


class UnsupportedEnvironment(ImportError):
    """A dependency of flashmla-cupy is missing or too old; the message is one line that says
    what to install."""


def parse(version: str) -> tuple[int, ...]:
    """``"14.0.1"`` -> ``(14, 0, 1)``; the leading release numbers of a version string."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def installed(distribution: str) -> str | None:
    """The installed version of a distribution, or ``None``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def cupy_packages() -> dict[str, str]:
    """Installed CuPy distributions and their versions, e.g. ``{"cupy-cuda12x": "14.2.0"}``."""
    found = {}
    for name in CUPY_PACKAGES:
        v = installed(name)
        if v is not None:
            found[name] = v
    return found


def _too_old(label: str, version: str, minimum: str, fix: str) -> str | None:
    if parse(version) < parse(minimum):
        return f"{label} {version} is older than {minimum}, the oldest that flashmla-cupy supports: {fix}"
    return None


def _upgrade_hint(cuda_major: int | None, fallback: str) -> str:
    """The install command that brings a package of this CUDA major up to date."""
    if cuda_major in SUPPORTED_CUDA:
        return f"pip install -U 'flashmla-cupy[cu{cuda_major}]'"
    return fallback


def _cupy_problem() -> str | None:
    found = cupy_packages()
    if len(found) > 1:
        listed = ", ".join(f"{n} {v}" for n, v in found.items())
        return (f"several CuPy packages are installed ({listed}), which overwrite each other's files: "
                f"uninstall all of them, then install the one for your CUDA major ({INSTALL_HINT})")
    if not found:
        if importlib.util.find_spec("cupy") is not None:
            return None                 # importable without metadata (e.g. a build on PYTHONPATH)
        return f"CuPy is not installed: {INSTALL_HINT}"
    (name, version), = found.items()
    major = CUPY_PACKAGES[name]
    if major is not None and major not in SUPPORTED_CUDA:
        return f"{name} is for CUDA {major}; flashmla-cupy needs CUDA 12 or 13: {INSTALL_HINT}"
    return _too_old(f"CuPy ({name})", version, MINIMUM["cupy"],
                    _upgrade_hint(major, f"pip install -U '{name}>={MINIMUM['cupy']}'"))


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:         # its parent package is missing too
        return False


def environment_problem() -> str | None:
    """One line saying why flashmla-cupy cannot run with the installed packages, or ``None``."""
    problem = _cupy_problem()
    if problem:
        return problem
    for name, module in (("numpy", "numpy"), ("ml_dtypes", "ml_dtypes"),
                         ("cuda-bindings", "cuda.bindings"), ("rich", "rich")):
        version = installed(name)
        if version is None:
            if _importable(module):
                continue                # no metadata to read: trust it
            hint = INSTALL_HINT if name == "cuda-bindings" else f"pip install '{name}>={MINIMUM[name]}'"
            return f"{name} is not installed: {hint}"
        fix = f"pip install -U '{name}>={MINIMUM[name]}'"
        if name == "cuda-bindings":
            fix = _upgrade_hint(parse(version)[0], INSTALL_HINT)
        problem = _too_old(name, version, MINIMUM[name], fix)
        if problem:
            return problem
    return None


def check_environment() -> None:
    """Raise ``UnsupportedEnvironment`` (one line) where flashmla-cupy cannot run. Left uncaught,
    as in the command line or ``python -c``, it prints that line alone, without a traceback."""
    problem = environment_problem()
    if problem:
        _print_uncaught_in_one_line()
        raise UnsupportedEnvironment(problem)


def _print_uncaught_in_one_line() -> None:
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, UnsupportedEnvironment):
            print(f"flashmla-cupy: {value}", file=sys.stderr)
        else:
            previous(kind, value, tb)

    sys.excepthook = hook


# --------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------

def driver_cuda_version() -> int | None:
    """The CUDA version the installed driver supports (e.g. 12080 for 12.8), or ``None`` where no
    NVIDIA driver is installed (libcuda cannot be loaded). Needs no GPU and no ``cuInit``."""
    try:
        lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
        return None
    return v.value


def cuda_text(version: int) -> str:
    """``12080`` -> ``"12.8"``."""
    return f"{version // 1000}.{version % 1000 // 10}"


def cupy_cuda_major() -> int | None:
    """The CUDA major of the installed CuPy wheel (``None`` for a build without a wheel name)."""
    for name in cupy_packages():
        if CUPY_PACKAGES[name] is not None:
            return CUPY_PACKAGES[name]
    return None


def install_command(*extras: str) -> str:
    """The pip command that adds ``extras`` for the CUDA major of the installed CuPy, e.g.
    ``pip install 'flashmla-cupy[cu12,profile]'``."""
    major = cupy_cuda_major()
    if major in SUPPORTED_CUDA:
        return f"pip install 'flashmla-cupy[{','.join((f'cu{major}', *extras))}]'"
    names = "".join(f",{e}" for e in extras)
    return f"pip install 'flashmla-cupy[cu12{names}]' (CUDA 12) or 'flashmla-cupy[cu13{names}]' (CUDA 13)"


def driver_problem() -> str | None:
    """Why no GPU can be used because of the driver, in one line: none installed, or older than the
    CUDA major of the installed CuPy. ``None`` where the driver fits (or nothing can be said)."""
    version = driver_cuda_version()
    if version is None:
        return "no NVIDIA driver installed: libcuda.so.1 not found"
    major = cupy_cuda_major()
    if major is not None and version // 1000 < major:
        other = " or install 'flashmla-cupy[cu12]' instead" if major > 12 else ""
        return (f"the NVIDIA driver supports CUDA {cuda_text(version)}, older than the CUDA {major} of "
                f"{'cupy-cuda%dx' % major}: update the driver to >= {MIN_DRIVER[major]}{other}")
    return None
