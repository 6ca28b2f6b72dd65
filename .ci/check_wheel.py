"""CI: the wheel from tools/build_wheel.py, installed, answers every program's sm_90a cubin from
the cubins it ships, with NVRTC barred (any compile attempt fails the check).

    cd /somewhere/else && python /path/to/.ci/check_wheel.py

Run outside the checkout so that the installed package is imported, not the source tree.
"""
from __future__ import annotations

import sys
import time

t0 = time.perf_counter()
import flashmla_cupy  # noqa: E402
from flashmla_cupy import bundled, compiler, programs  # noqa: E402

t_import = time.perf_counter() - t0


def barred(program, *args, **kwargs):
    raise SystemExit(f"FAIL: NVRTC was asked to compile {program.name}: the wheel lacks its cubin")


def main() -> int:
    where = bundled.directory()
    if "site-packages" not in str(where):
        print(f"FAIL: flashmla_cupy imported from {where.parent}, not from an installed wheel")
        return 1
    compiler.compile_program = barred
    t1 = time.perf_counter()
    cubins = [compiler.build(p, "sm_90a") for p in programs.all_programs()]
    t_lookup = time.perf_counter() - t1
    for c in cubins:
        header, _ = compiler.read_entry(c.path)
        print(f"  {c.program.name:<24} {len(c.image) / 1024:6.0f} KiB  bundled={c.bundled}  "
              f"built by NVRTC {header['toolchain']['nvrtc']}")
    if not all(c.bundled for c in cubins):
        print("FAIL: some cubins did not come from the wheel")
        return 1
    print(f"OK: {len(cubins)} programs from {where} without NVRTC; import {t_import * 1e3:.0f} ms, "
          f"all lookups {t_lookup * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
