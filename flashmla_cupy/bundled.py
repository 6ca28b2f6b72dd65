"""Cubins shipped inside the wheel, so that a fresh install runs its first call without compiling.

``tools/build_wheel.py`` compiles every program of ``programs.all_programs()`` for ``sm_90a`` with
NVRTC (no GPU needed) and stores the cubins in ``flashmla_cupy/cubins/`` of the wheel it builds,
in the cache's file format (header with the compile log and the toolchain, checksum). A source
checkout, an sdist or a plain ``pip install .`` has no such directory and compiles on first use.

A shipped cubin is found by its program's identity (``Program.identity_key``): the content of
every file under ``cuda_src/``, the program's source, kernels and defines, the NVRTC options
(``FLASHMLA_CUPY_EXTRA_OPTIONS`` included) and the arch. That is the disk cache's key without the
local toolchain, since a cubin does not depend on the NVRTC of the machine that loads it. Editing
any device source, or setting extra options, changes the identity, so a stale cubin is never
found; the identity in the file's header is compared too, not only the name's prefix.

The wheel's cubins come from NVRTC 12, whose sm_90a cubins load on CUDA 12 and 13 drivers alike;
where a driver refuses one all the same, ``launch.Kernel`` compiles the program with NVRTC.
"""
from __future__ import annotations

import threading
import warnings
from pathlib import Path

from . import compiler
from .compiler import CacheWarning, Cubin, Program

_found: dict[str, Cubin] = {}
_lock = threading.Lock()


def directory() -> Path:
    """Where the wheel keeps its cubins (absent in a source checkout)."""
    return Path(__file__).resolve().parent / "cubins"


def file_name(program: Program, arch: str, identity: str) -> str:
    return f"{program.slug}-{arch}-{identity[:32]}.cubin"


def lookup(program: Program, arch: str) -> Cubin | None:
    """The shipped cubin of ``program`` for ``arch``, or ``None`` (none shipped, or shipped for
    other sources or options)."""
    folder = directory()
    if not folder.is_dir():
        return None
    identity = program.identity_key(arch)
    with _lock:
        hit = _found.get(identity)
    if hit is not None:
        return hit
    path = folder / file_name(program, arch, identity)
    try:
        header, image = compiler.read_entry(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        warnings.warn(f"flashmla-cupy: bundled cubin {path} is unusable ({e}); compiling with NVRTC instead",
                      CacheWarning, stacklevel=3)
        return None
    lowered = header.get("lowered", {})
    if header.get("identity") != identity or set(lowered) != set(program.kernels):
        return None
    cubin = Cubin(program, arch, image, lowered, header.get("log", ""), header.get("compile_seconds", 0.0),
                  from_cache=True, path=path, bundled=True,
                  resources=compiler.kernel_resources(image, header.get("log", ""), lowered))
    with _lock:
        _found[identity] = cubin
    return cubin


def write(cubins: list[Cubin], folder: Path) -> list[Path]:
    """Store cubins under ``folder`` (a package's ``cubins/`` directory), named by identity."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for c in cubins:
        path = folder / file_name(c.program, c.arch, c.program.identity_key(c.arch))
        path.write_bytes(compiler.serialize(c))
        paths.append(path)
    return paths


def entries() -> list[tuple[Path, dict | None, int]]:
    """``(path, header or None if unreadable, size)`` for every shipped cubin."""
    return compiler.cubin_entries(directory())
