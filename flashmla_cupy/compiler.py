"""Run-time compilation of ``cuda_src/`` with NVRTC (through CuPy) and the on-disk cubin cache.

Everything that turns device source into a loadable cubin lives here:

* where the headers are: ``cuda_src/`` itself, the CUTLASS/CuTe headers shipped inside the
  ``nvidia-cutlass`` wheel (found without importing its Python package), CuPy's bundled CCCL, and
  the CUDA runtime headers (the ``nvidia-cuda-runtime`` wheel or a toolkit);
* which options NVRTC gets (``-arch=sm_90a -std=c++17 -default-device``, the ptxas report, and
  ``--no-cache`` for NVRTC 12.9+: see ``nvrtc_cache_options``);
* the cache: one file per program, keyed by the program's identity (the content of every file
  under ``cuda_src/``, its source, kernels and defines, the options and the arch) and the CUTLASS,
  NVRTC, CuPy and CUDA-header versions; written atomically and verified by a checksum when read,
  so that concurrent or interrupted writers never leave a bad entry behind.

``build`` looks first among the cubins shipped inside the wheel (``flashmla_cupy.bundled``, found
by the identity alone, without NVRTC), then in memory, then in the cache, and compiles last.

Compiling needs no GPU: give ``arch`` explicitly (``flashmla-cupy compile --arch sm_90a``).

Environment:
  ``FLASHMLA_CUPY_CACHE_DIR``    cache directory (default ``$XDG_CACHE_HOME/flashmla-cupy``)
  ``FLASHMLA_CUPY_COMPILE_LOG``  if set to 1, print each program's compiler log (ptxas report)
  ``FLASHMLA_CUPY_EXTRA_OPTIONS`` more NVRTC options for every program, whitespace-separated
                                 (part of the cache key), e.g. ``-lineinfo`` for source lines in
                                 compute-sanitizer and Nsight reports
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import struct
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

CACHE_FORMAT = 1
DEFAULT_ARCH = "sm_90a"
BASE_OPTIONS = ("-std=c++17", "-default-device", "--ptxas-options=-v", "-DNDEBUG")

_MAGIC = b"FMLACUBN"


class CompileError(RuntimeError):
    """NVRTC rejected a program; the message carries the compiler log."""


class CacheWarning(UserWarning):
    """The cubin cache could not be used as intended (read-only, corrupted entry)."""


# --------------------------------------------------------------------------------------------
# Where things are
# --------------------------------------------------------------------------------------------

def source_dir() -> Path:
    """``cuda_src/``: inside the installed package, or beside it in a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "mla").is_dir():
            return candidate
    raise FileNotFoundError(f"cuda_src/ not found next to {here}")


def _package_dirs(name: str) -> list[Path]:
    """Directories of a top-level (possibly namespace) package, located without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def cutlass_include_dir() -> Path:
    env = os.environ.get("FLASHMLA_CUPY_CUTLASS_INCLUDE")
    candidates = [Path(env)] if env else []
    candidates += [d / "source" / "include" for d in _package_dirs("cutlass_library")]
    for c in candidates:
        if (c / "cute" / "tensor.hpp").is_file():
            return c
    raise FileNotFoundError(
        "CUTLASS/CuTe headers not found: install the 'nvidia-cutlass' wheel "
        "(it ships them under cutlass_library/source/include) or set FLASHMLA_CUPY_CUTLASS_INCLUDE"
    )


def cccl_include_dir() -> Path:
    for pkg in _package_dirs("cupy"):
        d = pkg / "_core" / "include" / "cupy" / "_cccl" / "libcudacxx"
        if d.is_dir():
            return d
    raise FileNotFoundError("CCCL (libcu++) headers not found inside the CuPy package")


def cuda_runtime_include_dir() -> Path:
    """``cuda_runtime_api.h``: the nvidia-cuda-runtime wheel (CUDA 12 or 13 layout) or a toolkit."""
    candidates = []
    for nvidia in _package_dirs("nvidia"):
        candidates += [nvidia / "cuda_runtime" / "include", nvidia / "cu13" / "include"]
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda_runtime_api.h").is_file():
            return c
    from .versions import install_command
    raise FileNotFoundError(
        f"CUDA runtime headers (cuda_runtime_api.h) not found: {install_command()} "
        "or set CUDA_PATH to a CUDA toolkit"
    )


def _cccl_prefix_dir() -> Path:
    """A directory holding ``cccl -> <CuPy's libcudacxx>``.

    Built for CUDA 13 compilers, CUTLASS includes ``<cccl/cuda/std/...>`` (a CUDA 13 toolkit's
    layout); the same headers ship in CuPy under ``libcudacxx/cuda/std``, so a link bridges them.
    """
    target = cccl_include_dir()
    for base in (cache_dir().parent, Path(tempfile.gettempdir()) / f"flashmla-cupy-{os.getuid()}"):
        shim = base / "include-shim" / hashlib.sha256(str(target).encode()).hexdigest()[:12]
        link = shim / "cccl"
        try:
            if link.is_symlink() and Path(os.readlink(link)) == target:
                return shim
            shim.mkdir(parents=True, exist_ok=True)
            tmp = shim / f".cccl.{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            tmp.symlink_to(target, target_is_directory=True)
            os.replace(tmp, link)
            return shim
        except OSError:
            continue
    raise OSError("cannot create the CCCL include shim (no writable cache or temp directory)")


def include_dirs() -> list[Path]:
    dirs = [source_dir(), cutlass_include_dir(), cccl_include_dir(), cuda_runtime_include_dir()]
    if _nvrtc().getVersion()[0] >= 13:
        dirs.append(_cccl_prefix_dir())
    return dirs


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc


def _define_value(header: Path, pattern: str) -> str:
    m = re.search(pattern, header.read_text(errors="replace"), re.M)
    return m.group(1) if m else "?"


def toolchain() -> dict:
    """Versions that change the generated code (all part of the cache key)."""
    import cupy

    cutlass_h = cutlass_include_dir() / "cutlass" / "version.h"
    cutlass = ".".join(_define_value(cutlass_h, rf"^#define CUTLASS_{p}\s+(\d+)")
                       for p in ("MAJOR", "MINOR", "PATCH"))
    cudart = _define_value(cuda_runtime_include_dir() / "cuda_runtime_api.h",
                           r"^#define CUDART_VERSION\s+(\d+)")
    return {
        "nvrtc": "%d.%d" % _nvrtc().getVersion(),
        "cutlass": cutlass,
        "cupy": cupy.__version__,
        "cudart_headers": cudart,
    }


def cache_dir() -> Path:
    env = os.environ.get("FLASHMLA_CUPY_CACHE_DIR")
    if env:
        base = Path(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = Path(xdg) / "flashmla-cupy"
    return base / f"v{CACHE_FORMAT}"


def sources_digest() -> str:
    """Hash of every file under ``cuda_src/`` (path and content): editing any header changes it."""
    root = source_dir()
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".cu", ".cuh")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def extra_options() -> list[str]:
    """``FLASHMLA_CUPY_EXTRA_OPTIONS``, split on whitespace."""
    return os.environ.get("FLASHMLA_CUPY_EXTRA_OPTIONS", "").split()


def nvrtc_cache_options() -> list[str]:
    """``--no-cache`` for NVRTC 12.9+, which keeps compiled programs in the driver's compute cache
    (``~/.nv/ComputeCache``; only where libcuda loads, so never on a machine without a driver) and
    answers a repeated compile from there without running ptxas: the log then has no ``-v``
    report. Our own cache already keeps every cubin, so NVRTC's is switched off."""
    return ["--no-cache"] if _nvrtc().getVersion() >= (12, 9) else []


# --------------------------------------------------------------------------------------------
# Programs and compiled cubins
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Program:
    """One NVRTC translation unit: a ``.cu`` file under ``cuda_src/`` and the kernels to keep."""
    name: str                       # display name, e.g. "splitkv_mla<bf16>"
    source: str                     # path relative to cuda_src/, e.g. "mla/splitkv_kernel.cu"
    kernels: tuple[str, ...]        # name expressions, e.g. "flashmla::splitkv_mla_kernel<...>"
    defines: tuple[tuple[str, str], ...] = ()

    def options(self, arch: str) -> list[str]:
        opts = [f"-arch={arch}", *BASE_OPTIONS, *extra_options(), *nvrtc_cache_options()]
        opts += [f"-D{k}={v}" for k, v in self.defines]
        opts += [f"-I{d}" for d in include_dirs()]
        return opts

    def identity(self, arch: str) -> dict:
        """Everything that decides what the cubin contains, apart from the compiler's version:
        every device source, this program's source, kernels and defines, the options that change
        the code (``FLASHMLA_CUPY_EXTRA_OPTIONS`` included) and the arch."""
        return {
            "format": CACHE_FORMAT, "arch": arch, "source": self.source,
            "kernels": list(self.kernels), "defines": list(self.defines),
            "options": [*BASE_OPTIONS, *extra_options()], "sources": sources_digest(),
        }

    def identity_key(self, arch: str) -> str:
        """The key of the cubins shipped in the wheel (``flashmla_cupy.bundled``), which load
        wherever the driver takes them, whatever NVRTC the machine has."""
        return _digest(self.identity(arch))

    def cache_key(self, arch: str) -> str:
        """The key of the disk cache: the identity and the local toolchain that compiles."""
        ident = self.identity(arch)
        ident["options"] += nvrtc_cache_options()
        ident["toolchain"] = toolchain()
        return _digest(ident)

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name).strip("_")


def _digest(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class KernelResources:
    """One kernel's registers, stack frame and stack with its callees (from the cubin), and spills
    (from ptxas's report in the compile log). -1: unknown (spills: the log has no report, but a
    0-byte stack rules them out, since spills live in the stack)."""
    registers: int = -1
    stack_bytes: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    cumulative_stack_bytes: int = -1

    @property
    def spills_reported(self) -> bool:
        return self.spill_stores >= 0 and self.spill_loads >= 0

    def __str__(self) -> str:
        spills = (f"{self.spill_stores} B spill stores, {self.spill_loads} B spill loads"
                  if self.spills_reported else "spills not reported")
        return (f"{self.registers} registers, {self.stack_bytes} B stack "
                f"({self.cumulative_stack_bytes} B with callees), {spills}")


@dataclass
class Cubin:
    program: Program
    arch: str
    image: bytes
    lowered: dict[str, str]          # name expression -> mangled kernel name
    log: str
    compile_seconds: float
    from_cache: bool = False         # not compiled by this process (disk cache or bundled)
    path: Path | None = None
    bundled: bool = False            # shipped inside the wheel (flashmla_cupy.bundled)
    resources: dict[str, KernelResources] = field(default_factory=dict)


def kernel_resources(image: bytes, log: str, lowered: dict[str, str]) -> dict[str, KernelResources]:
    """Per kernel (keyed by name expression): registers and stack from the cubin (always there),
    spills from the log's ptxas report when it has one."""
    from .cubin_info import kernel_resources as from_cubin

    reported = parse_ptxas_report(log, lowered)
    in_cubin = from_cubin(image)
    out = {}
    for expr, mangled in lowered.items():
        r, c = reported[expr], in_cubin.get(mangled, {})
        out[expr] = KernelResources(
            registers=c.get("registers", r.registers), stack_bytes=c.get("stack_bytes", r.stack_bytes),
            spill_stores=r.spill_stores, spill_loads=r.spill_loads,
            cumulative_stack_bytes=c.get("cumulative_stack_bytes", r.cumulative_stack_bytes))
    return out


def parse_ptxas_report(log: str, lowered: dict[str, str]) -> dict[str, KernelResources]:
    """Registers and spills per kernel (keyed by name expression) from a ``-v`` ptxas log."""
    by_mangled: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line) or \
            re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = by_mangled.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current.update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
            m = re.search(r"(\d+) bytes cumulative stack size", line)      # printed when not 0
            current["cumulative_stack_bytes"] = int(m.group(1)) if m else current.get("stack_bytes", -1)
    return {expr: KernelResources(**by_mangled.get(mangled, {})) for expr, mangled in lowered.items()}


def compile_program(program: Program, arch: str = DEFAULT_ARCH) -> Cubin:
    """Compile with NVRTC, bypassing the cache (no GPU needed)."""
    nvrtc = _nvrtc()
    path = source_dir() / program.source
    code = path.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    prog = nvrtc.createProgram(code, program.source, [], [])
    try:
        for expr in program.kernels:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, program.options(arch))
        except nvrtc.NVRTCError as e:
            raise CompileError(f"NVRTC failed on {program.name} ({program.source}, {arch}): {e}\n"
                               + nvrtc.getProgramLog(prog)) from None
        log = nvrtc.getProgramLog(prog).rstrip("\0")
        # CuPy's getCUBIN drops the image's trailing NUL byte; put it back.
        image = bytes(nvrtc.getCUBIN(prog)) + b"\0"
        lowered = {expr: nvrtc.getLoweredName(prog, expr) for expr in program.kernels}
    finally:
        nvrtc.destroyProgram(prog)
    seconds = time.perf_counter() - t0
    return Cubin(program, arch, image, lowered, log, seconds,
                 resources=kernel_resources(image, log, lowered))


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------

_memory: dict[str, Cubin] = {}
_lock = threading.Lock()
_warned_readonly = False


def entry_path(program: Program, arch: str) -> Path:
    return cache_dir() / f"{program.slug}-{arch}-{program.cache_key(arch)[:32]}.cubin"


def serialize(c: Cubin) -> bytes:
    """A cache file: magic, header (program, identity, log, toolchain, checksum), image."""
    header = json.dumps({
        "program": c.program.name, "arch": c.arch, "identity": c.program.identity_key(c.arch),
        "lowered": c.lowered, "log": c.log,
        "compile_seconds": c.compile_seconds, "size": len(c.image),
        "sha256": hashlib.sha256(c.image).hexdigest(), "toolchain": toolchain(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }).encode()
    return _MAGIC + struct.pack("<I", len(header)) + header + c.image


def read_entry(path: Path) -> tuple[dict, bytes]:
    """Header and image of a cache file; ``ValueError`` if the file is truncated or corrupted."""
    data = path.read_bytes()
    if len(data) < 12 or data[:8] != _MAGIC:
        raise ValueError("bad magic")
    (hlen,) = struct.unpack("<I", data[8:12])
    try:
        header = json.loads(data[12:12 + hlen])
    except ValueError:
        raise ValueError("unreadable header") from None
    image = data[12 + hlen:]
    if len(image) != header.get("size") or hashlib.sha256(image).hexdigest() != header.get("sha256"):
        raise ValueError("checksum mismatch (truncated or corrupted)")
    return header, image


def _load_entry(program: Program, arch: str, path: Path) -> Cubin | None:
    try:
        header, image = read_entry(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        warnings.warn(f"flashmla-cupy: cache entry {path} is unusable ({e}); rebuilding it",
                      CacheWarning, stacklevel=3)
        return None
    lowered = header["lowered"]
    if set(lowered) != set(program.kernels):
        return None
    return Cubin(program, arch, image, lowered, header["log"], header["compile_seconds"],
                 from_cache=True, path=path, resources=kernel_resources(image, header["log"], lowered))


def _store_entry(c: Cubin, path: Path) -> None:
    """Write atomically: a private temporary file in the same directory, then ``os.replace``."""
    global _warned_readonly
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(serialize(c))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        c.path = path
    except OSError as e:
        if not _warned_readonly:
            _warned_readonly = True
            warnings.warn(f"flashmla-cupy: cannot write the cubin cache at {path.parent} ({e}); "
                          "compiled kernels are kept in memory for this process only "
                          "(set FLASHMLA_CUPY_CACHE_DIR to a writable directory)",
                          CacheWarning, stacklevel=3)


def _print_log(c: Cubin) -> None:
    if os.environ.get("FLASHMLA_CUPY_COMPILE_LOG", "") not in ("", "0"):
        print(f"--- compiler log for {c.program.name} ({c.arch}) ---\n{c.log.strip()}",
              file=sys.stderr)


def build(program: Program, arch: str = DEFAULT_ARCH, *, status: bool = True, bundled: bool = True) -> Cubin:
    """The cubin for ``program``: shipped in the wheel (unless ``bundled=False``), from memory,
    from the disk cache, or compiled (and cached).

    A cold compile shows a status line with the kernel's name and the elapsed time on stderr.
    """
    if bundled:
        from . import bundled as shipped
        cubin = shipped.lookup(program, arch)
        if cubin is not None:
            return cubin
    key = program.cache_key(arch)
    with _lock:
        hit = _memory.get(key)
    if hit is not None:
        return hit
    path = entry_path(program, arch)
    cubin = _load_entry(program, arch, path)
    if cubin is None:
        cubin = _compile_with_status(program, arch) if status else compile_program(program, arch)
        _store_entry(cubin, path)
    _print_log(cubin)
    with _lock:
        _memory[key] = cubin
    return cubin


def _compile_with_status(program: Program, arch: str) -> Cubin:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("[bold]flashmla-cupy[/] compiling {task.description}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        progress.add_task(f"{program.name} for {arch} (NVRTC, first use only)", total=None)
        cubin = compile_program(program, arch)
    console.print(f"[bold]flashmla-cupy[/] compiled {program.name} for {arch} "
                  f"in {cubin.compile_seconds:.1f} s", highlight=False)
    return cubin


def build_many(programs: list[Program], arch: str = DEFAULT_ARCH, jobs: int | None = None,
               on_done=None, *, bundled: bool = True) -> list[Cubin]:
    """Build several programs, compiling the missing ones in parallel processes (the cubins
    shipped in the wheel count as built, unless ``bundled=False``).

    ``on_done(cubin)`` is called as each one finishes (for progress display).
    """
    import concurrent.futures as cf
    import multiprocessing

    from . import bundled as shipped

    results: dict[int, Cubin] = {}
    missing = []
    for i, p in enumerate(programs):
        cubin = (shipped.lookup(p, arch) if bundled else None) or _load_entry(p, arch, entry_path(p, arch))
        if cubin is not None:
            results[i] = cubin
            if on_done:
                on_done(cubin)
        else:
            missing.append(i)
    if missing:
        jobs = jobs or min(len(missing), os.cpu_count() or 1)
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(compile_program, programs[i], arch): i for i in missing}
            for fut in cf.as_completed(futures):
                cubin = fut.result()
                _store_entry(cubin, entry_path(cubin.program, arch))
                results[futures[fut]] = cubin
                if on_done:
                    on_done(cubin)
    with _lock:
        for c in results.values():
            if not c.bundled:
                _memory[c.program.cache_key(arch)] = c
    return [results[i] for i in range(len(programs))]


def cache_entries() -> list[tuple[Path, dict | None, int]]:
    """``(path, header or None if unreadable, size)`` for every file in the cache directory."""
    return cubin_entries(cache_dir())


def cubin_entries(folder: Path) -> list[tuple[Path, dict | None, int]]:
    """``(path, header or None if unreadable, size)`` for every cubin file in ``folder``."""
    out = []
    if folder.is_dir():
        for p in sorted(folder.glob("*.cubin")):
            try:
                header, _ = read_entry(p)
            except (OSError, ValueError):
                header = None
            out.append((p, header, p.stat().st_size))
    return out
