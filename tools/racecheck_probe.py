"""Which of the split-KV kernel's synchronization patterns does compute-sanitizer's racecheck follow?

The kernel passes row_max / scale0 / scale1 between its two warpgroups with named barriers (the
producer writes shared memory and does ``bar.arrive``, the consumer does ``bar.sync`` on the same
id and reads: PTX orders the writes before the reads), has warpgroup-local barriers, one writer
per quad, TMA mbarrier waits and plain ``__syncthreads``. This probe runs each pattern alone in a
small kernel on the same helpers (cuda_src/common/sync.cuh), under racecheck, and checks each
kernel's result: a correct protocol that racecheck reports is a false positive of the tool, and
the racy control ("none") must be reported, or the other verdicts mean nothing.

    python tools/racecheck_probe.py             # every mode under racecheck, one line each
    python tools/racecheck_probe.py --run MODE  # one probe kernel, no sanitizer

Exit status 0 when every correct mode computed exact sums and the racy control was reported.
Environment: COMPUTE_SANITIZER (default: on PATH, then /usr/local/cuda/bin).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> (kernel mode, is the protocol correct?, what it exercises)
MODES = {
    "arrive":   (0, True,  "hand-off: producer bar.arrive, consumer bar.sync (the kernel's form)"),
    "sync":     (1, True,  "hand-off: both bar.sync"),
    "none":     (2, False, "hand-off without barriers: a real race, racecheck must report it"),
    "block":    (3, True,  "exchange across __syncthreads"),
    "partial":  (4, True,  "warpgroup 0 also syncs alone (bar.sync 3, 128), then the exchange"),
    "quad":     (5, True,  "one writer per quad after __syncwarp, then the exchange"),
    "mbarrier": (6, True,  "all threads first wait on an mbarrier (as on TMA loads), then the exchange"),
}
ROUNDS = 64

SOURCE = r"""
#include "common/sync.cuh"
using namespace flashmla;

// Modes 0-2: warpgroup 0 writes 128 floats per round, warpgroup 1 reads another thread's float,
// handing the buffer back and forth (0: arrive -> sync, 1: sync -> sync, 2: no barrier).
// Modes 3-6: every thread writes its float, __syncthreads, reads the other warpgroup's float,
// __syncthreads; with the extra synchronization of the mode before it.
template <int kMode>
__global__ void __launch_bounds__(256) racecheck_probe(float* sums, int rounds) {
    __shared__ float buf[256];
    __shared__ __align__(8) uint64_t bar;
    const int wg = threadIdx.x / 128, i = threadIdx.x % 128;
    if (kMode == 6 && threadIdx.x == 0) {
        mbarrier_init(smem_u32(&bar), 1);
        mbarrier_init_fence();
    }
    __syncthreads();
    float acc = 0.0f;
    for (int r = 0; r < rounds; ++r) {
        if (kMode <= 2) {
            const bool sync_producer = kMode == 1;
            if (wg == 0) {
                if (r > 0 && kMode != 2) named_barrier_sync(2, 256);     // warpgroup 1 has read
                buf[i] = float(r * 256 + i);
                if (kMode != 2) {
                    if (sync_producer) named_barrier_sync(1, 256); else named_barrier_arrive(1, 256);
                }
            } else {
                if (kMode != 2) named_barrier_sync(1, 256);
                acc += buf[(i + 1) % 128];
                if (r + 1 < rounds && kMode != 2) {
                    if (sync_producer) named_barrier_sync(2, 256); else named_barrier_arrive(2, 256);
                }
            }
            continue;
        }
        if (kMode == 4 && wg == 0) named_barrier_sync(3, 128);
        if (kMode == 6) {
            if (threadIdx.x == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(&bar)) : "memory");
            mbarrier_wait(smem_u32(&bar), r & 1);
        }
        if (kMode == 5) {
            __syncwarp();
            if (threadIdx.x % 4 == 0) {
                for (int k = 0; k < 4; ++k) buf[threadIdx.x + k] = float(r * 256 + threadIdx.x + k);
            }
        } else {
            buf[threadIdx.x] = float(r * 256 + threadIdx.x);
        }
        __syncthreads();
        acc += buf[(threadIdx.x + 129) % 256];
        __syncthreads();
    }
    sums[threadIdx.x] = acc;
}
"""


def expected_sums(mode: int):
    import numpy as np

    t = np.arange(256)
    other = (t + 1) % 128 if mode <= 2 else (t + 129) % 256
    sums = sum(float(r * 256) + other for r in range(ROUNDS)).astype(np.float32)
    if mode <= 2:
        sums[128:] = sums[:128]                # warpgroup 1 (threads 128-255) reads in these modes
        sums[:128] = 0.0
    return sums


def run_probe(name: str) -> int:
    import cupy
    import numpy as np

    from flashmla_cupy import compiler

    mode, correct, _ = MODES[name]
    options = ("-std=c++17", *(f"-I{d}" for d in compiler.include_dirs()))   # CuPy adds -arch
    names = [f"racecheck_probe<{m}>" for m, _, _ in MODES.values()]
    module = cupy.RawModule(code=SOURCE, options=options, name_expressions=names, backend="nvrtc")
    kernel = module.get_function(f"racecheck_probe<{mode}>")
    sums = cupy.full(256, np.nan, dtype=np.float32)
    kernel((1,), (256,), (sums, np.int32(ROUNDS)))
    ok = bool((cupy.asnumpy(sums) == expected_sums(mode)).all())
    print(f"probe {name}: sums {'exact' if ok else 'WRONG'}")
    return 0 if ok or not correct else 1


def find_sanitizer() -> str:
    for candidate in (os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer"),
                      "/usr/local/cuda/bin/compute-sanitizer"):
        if candidate and Path(candidate).is_file():
            return candidate
    sys.exit("racecheck_probe: compute-sanitizer not found (set COMPUTE_SANITIZER)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", choices=sorted(MODES), help="run the probe itself in this form")
    args = ap.parse_args()
    if args.run:
        return run_probe(args.run)

    sanitizer = find_sanitizer()
    status = 0
    for name, (_, correct, what) in MODES.items():
        cmd = [sanitizer, "--tool", "racecheck", "--racecheck-report", "analysis",
               sys.executable, __file__, "--run", name]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        summary = re.search(r"RACECHECK SUMMARY: .*\((\d+) errors?", log)
        result = re.search(r"probe \w+: sums (\w+)", log)
        hazards = int(summary.group(1)) if summary else -1
        print(f"{name:<9} {'correct' if correct else 'racy':<8} racecheck errors {hazards:>4}  "
              f"sums {result.group(1) if result else '?':<6} {what}")
        if summary is None or result is None:
            print(log[-2000:])
            status = 1
        elif correct and result.group(1) != "exact":
            status = 1                    # a correct protocol computed wrong sums: the probe is broken
        elif not correct and hazards == 0:
            status = 1                    # racecheck missed a real race: its other verdicts mean nothing
    print("racecheck reports on a correct protocol are the tool's false positives")
    return status


if __name__ == "__main__":
    sys.exit(main())
