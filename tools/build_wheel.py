"""Build the wheel with ahead-of-time sm_90a cubins inside, so that a fresh install never compiles
on first use. Needs NVRTC and the headers (the package's own dependencies), no GPU.

    python tools/build_wheel.py [--out dist] [--jobs N]

Stages a copy of the package (pyproject.toml, README.md, flashmla_cupy/, cuda_src/) in a temporary
directory, compiles every program of ``programs.all_programs()`` for sm_90a into the copy's
``flashmla_cupy/cubins/`` (see flashmla_cupy/bundled.py: named by each program's identity, so a
later source change never loads them), and builds the wheel from the copy with pip. The checkout
is left as it is: ``pip install .`` and the sdist build no cubins and compile on first use.

Build with NVRTC 12 (an environment with the cu12 extra): its sm_90a cubins load on CUDA 12 and
13 drivers alike, where NVRTC 13's need a CUDA 13 driver.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCH = "sm_90a"
STAGED = ("pyproject.toml", "README.md", "flashmla_cupy", "cuda_src")


def stage(dest: Path) -> None:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "cubins")
    dest.mkdir(parents=True)
    for name in STAGED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=skip)
        else:
            shutil.copy2(src, dest / name)


def compile_into(package: Path, jobs: int | None) -> list:
    """Compile every program from the staged sources and store the cubins in the package."""
    sys.path.insert(0, str(package.parent))
    from flashmla_cupy import bundled, compiler, programs

    assert Path(compiler.__file__).resolve().is_relative_to(package.resolve()), compiler.__file__
    nvrtc = "%d.%d" % compiler._nvrtc().getVersion()
    if not nvrtc.startswith("12."):
        print(f"warning: NVRTC {nvrtc}: CUDA 12 drivers refuse its cubins (such machines compile on "
              "first use); build with NVRTC 12 (the cu12 extra) for cubins that every driver loads",
              file=sys.stderr)
    progs = programs.all_programs()
    t0 = time.perf_counter()
    cubins = compiler.build_many(progs, ARCH, jobs=jobs, bundled=False)
    print(f"compiled {len(cubins)} program(s) for {ARCH} with NVRTC {nvrtc} in "
          f"{time.perf_counter() - t0:.0f} s ({sum(not c.from_cache for c in cubins)} compiled, "
          f"{sum(c.from_cache for c in cubins)} from the cache)")
    bundled.write(cubins, package / "cubins")
    return [bundled.file_name(c.program, c.arch, c.program.identity_key(c.arch)) for c in cubins]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "dist", help="where the wheel goes (default dist/)")
    ap.add_argument("--jobs", type=int, help="parallel NVRTC processes (default: one per CPU)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="flashmla-cupy-wheel-") as tmp:
        src, built = Path(tmp) / "src", Path(tmp) / "wheel"
        stage(src)
        names = compile_into(src / "flashmla_cupy", args.jobs)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(built), str(src)],
                       check=True, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
        (made,) = built.glob("*.whl")
        args.out.mkdir(parents=True, exist_ok=True)
        wheel = args.out / made.name
        shutil.move(made, wheel)
    with zipfile.ZipFile(wheel) as z:
        inside = {Path(i.filename).name: i for i in z.infolist() if i.filename.startswith("flashmla_cupy/cubins/")}
    missing = sorted(set(names) - set(inside))
    if missing:
        print(f"error: {wheel.name} lacks {len(missing)} cubin(s): {', '.join(missing)}", file=sys.stderr)
        return 1
    raw = sum(inside[n].file_size for n in names)
    packed = sum(inside[n].compress_size for n in names)
    print(f"wrote {wheel} ({wheel.stat().st_size / 2**20:.2f} MiB): {len(names)} {ARCH} cubins, "
          f"{raw / 2**20:.2f} MiB ({packed / 2**20:.2f} MiB compressed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
