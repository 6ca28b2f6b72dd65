"""FlashMLA's own decoding kernels with time stamps: where a CTA's time goes, phase by phase.

    python tools/flashmla_upstream/timeline.py build FLASHMLA_SRC [--jobs N]
    python tools/flashmla_upstream/timeline.py sparse B H_Q S_Q TOPK [--calls N] [--save F.npy]
    python tools/flashmla_upstream/timeline.py dense B H_Q S_Q S_K [--calls N] [--save F.npy]

``build`` copies a FlashMLA 9241ae3 checkout, inserts the stamps below into its dense and sparse
split-KV kernels (each at a line of upstream's source, which must be there exactly as often as
the table says) and builds them with ``build.sh`` into ``libflashmla_stamped.so`` here (nvcc, no
GPU needed). ``sparse`` and ``dense`` load that library in place of ``libflashmla_up.so``
(``FLASHMLA_UP_LIB``), call FlashMLA through the stand-in ``flash_mla`` package on the profiler's
inputs after its 256 MiB L2 flush, and print the µs from each CTA's entry to its first phases and,
per request, between its phases (p10, median and p90 over CTAs, requests and calls), and from the
first CTA's entry to the last stamp.

A stamp is one thread's ``%globaltimer`` stored into a per-CTA row of a buffer that the shim
passes in a field the stamped build adds to upstream's params (``fm_probe``): thread 0 for the
CTA and its consumers, thread 256 for the sparse kernel's producer. Stores only: a stamp that
read a counter would wait behind the kernel's own loads. Per request, the first ``REQUESTS``
requests of a CTA get their own slots. Used to compare FlashMLA's phases with flashmla-cupy's
(docs/perf-notes.md section 53).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

HERE = Path(__file__).resolve().parent
STAMPED_LIB = HERE / "libflashmla_stamped.so"
MAX_CTAS = 1024               # rows of the stamp buffer (the grids here have at most the SMs' count)
SLOTS = 64                    # per CTA
REQUESTS = 7                  # requests of a CTA with slots of their own
FIRST_REQUEST_SLOT = 8        # request r, phase k: slot FIRST_REQUEST_SLOT + REQUEST_SLOTS r + k
REQUEST_SLOTS = 8
SPARE_SLOT = 2                # written only where a stamp's value test never holds

SPARSE = "csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh"
DENSE = "csrc/sm90/decode/dense/splitkv_mla.cuh"
PARAMS = "csrc/params.h"


class Stamp(NamedTuple):
    """``code`` inserted before or after (``after``) the ``occurrence``-th of the lines of ``path``
    that read ``line`` (stripped), which must occur ``count`` times."""
    path: str
    line: str
    occurrence: int
    count: int
    after: bool
    code: str


# Per kernel: the CTA slots (name by slot) and per-request phases (name by phase).
CTA_SLOTS = {0: "entry", 1: "scheduler row read", 3: "producer: page 0's indices", 4: "producer: page 0 out",
             5: "producer: done"}
REQUEST_PHASES = {0: "request start", 1: "Q arrived", 2: "pages done", 3: "row sums", 4: "O stores issued",
                  5: "O stores read (TMA)", 6: "end of request"}

# At each kernel's start: the stamp macros, with the slot layout above. FM_STAMP_AFTER(value, slot)
# stamps once `value` has arrived (it decides a store), FM_STAMP whenever the thread gets there.
_MACROS = r"""
    unsigned long long* const fm_probe_ = params.fm_probe;
    const int fm_cta_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
#define FM_STAMP(slot) do { if (fm_probe_) { unsigned long long t_; \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_) :: "memory"); \
        fm_probe_[fm_cta_ * SLOTS + (slot)] = t_; } } while (0)
#define FM_STAMP_AFTER(value, slot) do { \
        if ((value) == 0x7eadbeef && fm_probe_) fm_probe_[fm_cta_ * SLOTS + SPARE_SLOT] = 1; \
        FM_STAMP(slot); } while (0)
#define FM_REQUEST(phase) do { const int r_ = batch_idx - sched_meta.begin_req_idx; \
        if (r_ < REQUESTS) FM_STAMP(FIRST_REQUEST_SLOT + REQUEST_SLOTS * r_ + (phase)); } while (0)
    if (threadIdx.x == 0) FM_STAMP(0);
"""
_MACROS = re.sub(r"\b(SLOTS|SPARE_SLOT|REQUESTS|FIRST_REQUEST_SLOT|REQUEST_SLOTS)\b",
                 lambda m: str(globals()[m.group(1)]), _MACROS)

STAMPS = [
    Stamp(PARAMS, "struct DenseAttnDecodeParams { // TODO Change name to DenseAttnDecodeParams", 1, 1, True,
          "    unsigned long long* fm_probe;   // timeline.py"),
    Stamp(PARAMS, "struct SparseAttnDecodeParams {", 1, 1, True, "    unsigned long long* fm_probe;   // timeline.py"),
    # sparse: thread 0 is the first of warpgroup 0 (scores, left half of O), 256 the producer's
    Stamp(SPARSE, "const int idx_in_warpgroup = threadIdx.x % 128;", 1, 1, True, _MACROS),
    Stamp(SPARSE, "if (sched_meta.begin_req_idx >= params.b) return;", 1, 1, True, "    if (threadIdx.x == 0) FM_STAMP(1);"),
    Stamp(SPARSE, "rL[0] = rL[1] = 0.0f;", 1, 1, False, "            if (threadIdx.x == 0) FM_REQUEST(0);"),
    Stamp(SPARSE, "plan.bar_q.wait((sched_meta.begin_req_idx-batch_idx)&1);", 1, 1, True,
          "            if (threadIdx.x == 0) FM_REQUEST(1);"),
    Stamp(SPARSE, "// Synchronize L and M across warpgroups", 1, 1, False, "            if (threadIdx.x == 0) FM_REQUEST(2);"),
    Stamp(SPARSE, "NamedBarrier::arrive_and_wait(256, NamedBarriers::oBuf_free_and_sL_ready);", 1, 2, True,
          "            if (threadIdx.x == 0) FM_REQUEST(3);"),
    *(Stamp(SPARSE, line, 1, 2, True, "                if (threadIdx.x == 0) FM_REQUEST(4);") for line in (
        "store_o<true>(rO, gO, sOBuf, sOAccumBuf, plan, o_scales, tma_params, batch_idx, s_q_idx, head_block_idx, num_valid_seq_q, warpgroup_idx, idx_in_warpgroup);",
        "store_o<false>(rO, gOAccum, sOBuf, sOAccumBuf, plan, o_scales, tma_params, batch_idx, s_q_idx, head_block_idx, num_valid_seq_q, warpgroup_idx, idx_in_warpgroup);")),
    *(Stamp(SPARSE, "cute::tma_store_wait<0>();", k, 4, True, "                if (threadIdx.x == 0) FM_REQUEST(5);") for k in (1, 2)),
    Stamp(SPARSE, "sync_all_threads_in_cluster();", 1, 3, True, "            if (threadIdx.x == 0) FM_REQUEST(6);"),
    Stamp(SPARSE, "nxt_token_indexs[round] = __ldg(gIndices + args.start_block_idx*TOPK_BLOCK_SIZE + idx_in_cluster*(TOPK_BLOCK_SIZE/2) + round*NUM_TOKENS_PER_ROUND + my_token_idx_base);",
          1, 1, True,
          "                if (threadIdx.x == 256 && batch_idx == sched_meta.begin_req_idx) "
          "FM_STAMP_AFTER(nxt_token_indexs[round], 3);"),
    Stamp(SPARSE, "plan.bar_k_local_ready[buf_idx].arrive();", 1, 1, True,
          "                if (threadIdx.x == 256 && block_idx == args.start_block_idx && "
          "batch_idx == sched_meta.begin_req_idx) FM_STAMP(4);"),
    Stamp(SPARSE, "sync_all_threads_in_cluster();", 3, 3, False, "            if (threadIdx.x == 256) FM_STAMP(5);"),
    # dense: thread 0 is warpgroup 0's first; the loads are TMA's, issued by it
    Stamp(DENSE, "const int idx_in_warpgroup = threadIdx.x % 128;", 1, 1, True, _MACROS),
    Stamp(DENSE, "if (sched_meta.begin_req_idx >= params.b) return;", 1, 1, True, "    if (threadIdx.x == 0) FM_STAMP(1);"),
    Stamp(DENSE, "int seqlen_k = __ldg(params.seqlens_k_ptr + batch_idx);", 1, 1, True,
          "        if (threadIdx.x == 0) FM_REQUEST(0);"),
    Stamp(DENSE, "cur_phase_Q ^= 1;", 1, 1, True, "        if (threadIdx.x == 0) FM_REQUEST(1);"),
    Stamp(DENSE, "// Reduce rL across warpgroups", 1, 1, False, "        if (threadIdx.x == 0) FM_REQUEST(2);"),
    Stamp(DENSE, "// Prune out when rL is 0.0f or NaN", 1, 1, False, "        if (threadIdx.x == 0) FM_REQUEST(3);"),
    *(Stamp(DENSE, line, 1, 1, True, "            if (threadIdx.x == 0) FM_REQUEST(4);") for line in (
        "store_o<T, true>(rO, gO, rL, sO_addr, tma_params, batch_idx, k_head_idx, m_block_idx, num_valid_seq_q, warpgroup_idx, idx_in_warpgroup);",
        "store_o<T, false>(rO, gOAccum, rL, sO_addr, tma_params, batch_idx, k_head_idx, m_block_idx, num_valid_seq_q, warpgroup_idx, idx_in_warpgroup);")),
    *(Stamp(DENSE, "cute::tma_store_wait<0>();", k, 2, True, "            if (threadIdx.x == 0) FM_REQUEST(5);") for k in (1, 2)),
    Stamp(DENSE, "if (batch_idx != sched_meta.end_req_idx)", 1, 1, False, "        if (threadIdx.x == 0) FM_REQUEST(6);"),
]


def apply_stamps(root: Path, stamps=STAMPS) -> None:
    """Insert ``stamps`` into the sources under ``root`` (in place). Raises ValueError naming the
    line when a file does not hold it exactly as often as its stamp says (another FlashMLA)."""
    by_path: dict[str, list[Stamp]] = {}
    for s in stamps:
        by_path.setdefault(s.path, []).append(s)
    for path, group in by_path.items():
        lines = (root / path).read_text().split("\n")
        inserts = []
        for s in group:
            where = [i for i, text in enumerate(lines) if text.strip() == s.line]
            if len(where) != s.count:
                raise ValueError(f"{path}: expected {s.count} line(s) reading {s.line!r}, found {len(where)}: "
                                 "not FlashMLA 9241ae3's source")
            at = where[s.occurrence - 1]
            inserts.append((at + 1 if s.after else at, s.code))
        for at, code in sorted(inserts, key=lambda x: x[0], reverse=True):    # stable: later first
            lines[at:at] = code.strip("\n").split("\n")
        (root / path).write_text("\n".join(lines))


def build(src: Path, jobs: int) -> None:
    """A stamped copy of ``src`` (a FlashMLA 9241ae3 checkout) built into STAMPED_LIB."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "FlashMLA"
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns(".git"))
        apply_stamps(copy)
        env = dict(os.environ, FLASHMLA_UP_OUT=str(STAMPED_LIB), FLASHMLA_UP_NVCC_FLAGS="-DFLASHMLA_UP_STAMPS")
        env.setdefault("PYTHON", sys.executable)       # build.sh finds the CUTLASS headers through it
        subprocess.run(["bash", str(HERE / "build.sh"), str(copy), str(jobs)], env=env, check=True)


def phase_rows(stamps: np.ndarray, sparse: bool) -> list[tuple[str, np.ndarray]]:
    """(name, µs) per row, from ``stamps`` [calls, CTAs, SLOTS] (ns; 0 = not stamped): the CTA
    slots as µs after the CTA's entry, then per request (those with slots of their own) each
    phase's interval from the one before it, and from a request's end to the next one's start."""
    entry = stamps[:, :, 0]
    ran = (entry != 0) & (stamps[:, :, 1] != 0)                # an idle part returns before slot 1
    rows = []
    for slot, name in CTA_SLOTS.items():
        if slot == 0 or (slot >= 3 and not sparse):
            continue
        t = stamps[:, :, slot]
        rows.append((f"{name} (after entry)", ((t - entry) / 1e3)[ran & (t != 0)]))
    phase = lambda r, k: stamps[:, :, FIRST_REQUEST_SLOT + REQUEST_SLOTS * r + k]
    intervals = [(f"{REQUEST_PHASES[k - 1]} -> {REQUEST_PHASES[k]}", k - 1, k, 0) for k in range(1, len(REQUEST_PHASES))]
    intervals.append((f"{REQUEST_PHASES[len(REQUEST_PHASES) - 1]} -> next request's start", len(REQUEST_PHASES) - 1, 0, 1))
    for name, k0, k1, next_request in intervals:
        d = [((phase(r + next_request, k1) - phase(r, k0)) / 1e3)[ran & (phase(r, k0) != 0) & (phase(r + next_request, k1) != 0)]
             for r in range(REQUESTS - next_request)]
        rows.append((f"per request: {name}", np.concatenate(d)))
    return rows


def _requests_per_cta(stamps: np.ndarray) -> np.ndarray:
    ran = (stamps[:, :, 1] != 0)
    starts = stamps[:, :, [FIRST_REQUEST_SLOT + REQUEST_SLOTS * r for r in range(REQUESTS)]] != 0
    return starts.sum(-1)[ran]


def run(kind: str, shape: list[int], calls: int, save: Path | None = None) -> None:
    import cupy
    os.environ["FLASHMLA_UP_LIB"] = str(STAMPED_LIB)
    sys.path.insert(0, str(HERE))
    from flashmla_cupy.profiler import inputs, shapes, targets

    if kind == "sparse":
        b, h_q, s_q, topk = shape
        x = inputs.make_sparse_inputs(shapes.SparseShape(b, h_q, s_q, 32768, topk))
        prep = targets.setup_real_flash_mla_sparse(x)
    else:
        b, h_q, s_q, s_k = shape
        x = inputs.make_mla_inputs(shapes.MLAShape(b, s_k, h_q, s_q, False, (s_k,) * b))   # bf16, causal
        prep = targets.setup_real_flash_mla(x)
    buf = cupy.zeros((MAX_CTAS, SLOTS), dtype=np.uint64)
    os.environ["FLASHMLA_UP_STAMPS"] = hex(buf.data.ptr)
    flush = cupy.empty(256 << 20, dtype=np.uint8)
    samples = []
    for i in range(calls + 3):
        flush.fill(1)
        buf.fill(0)
        prep.run()
        cupy.cuda.runtime.deviceSynchronize()
        if i >= 3:
            samples.append(cupy.asnumpy(buf).astype(np.int64))
    stamps = np.stack(samples)
    if save:
        np.save(save, stamps)
    print(f"FlashMLA {kind} {' '.join(map(str, shape))}: requests per CTA "
          f"{np.bincount(_requests_per_cta(stamps)).tolist()} (index = requests), {calls} calls")
    first = np.where(stamps[:, :, 0] != 0, stamps[:, :, 0], np.iinfo(np.int64).max).min(1)
    last = stamps[:, :, FIRST_REQUEST_SLOT:FIRST_REQUEST_SLOT + REQUEST_SLOTS * REQUESTS].max((1, 2))
    print(f"first entry to the last stamp: median {np.median(last - first) / 1e3:.2f} us")
    for name, d in phase_rows(stamps, kind == "sparse"):
        if d.size:
            p10, p50, p90 = np.percentile(d, [10, 50, 90])
            print(f"  {name:58s} us: p10 {p10:8.2f}  median {p50:8.2f}  p90 {p90:8.2f}  (n {d.size})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="a stamped copy of a FlashMLA checkout -> libflashmla_stamped.so")
    b.add_argument("src", type=Path)
    b.add_argument("--jobs", type=int, default=4)
    for kind, last in (("sparse", "topk"), ("dense", "s_k")):
        r = sub.add_parser(kind, help=f"stamps of FlashMLA's {kind} call (b h_q s_q {last})")
        r.add_argument("shape", type=int, nargs=4, metavar=("B", "H_Q", "S_Q", last.upper()))
        r.add_argument("--calls", type=int, default=20)
        r.add_argument("--save", type=Path, help=f"the stamps, [calls, {MAX_CTAS}, {SLOTS}] ns (numpy .npy)")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        build(a.src, a.jobs)
    else:
        run(a.cmd, a.shape, a.calls, a.save)


if __name__ == "__main__":
    main()
