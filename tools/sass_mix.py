"""The instruction mix of the package's kernels, read from their SASS, for versions side by side.

    python tools/sass_mix.py [TREE ...] [--programs NAME;NAME] [--ops R2UR,ULOP3,...]

TREE: a directory holding a copy of the package (``flashmla_cupy/`` and ``cuda_src/``) or a git
revision of this checkout, as ``tools/ab_profile.py`` takes them; none: this checkout. Each tree's
programs (default: every MLA program) are built for sm_90a in a process started in that tree, or
taken from the cubin cache, which keys them by their sources; nvdisasm then disassembles each
cubin here. No GPU is needed.

Printed per program, a row for each tree: the instructions in all, the R2UR among the eight
instructions before a WGMMA (a descriptor made in vector registers and moved to the uniform ones
for it; 0 in the 16-bit kernel, which tests/test_compiler.py checks), and the count of each of
--ops (by default the uniform datapath's R2UR, ULOP3, UIADD3 and UMOV, the WGMMAs, and the
output's SEL, SHFL and STG).

Why: a change anywhere in the 16-bit split-KV kernel can move its page loop's WGMMA descriptors
from the uniform datapath into vector registers (an R2UR before each use) without a register or
a spill more, and cost 2-5 % on the GPU (docs/perf-notes.md section 51: R2UR 138 -> 916). Read
the counts before spending GPU time on a change.

nvdisasm comes from $NVDISASM, PATH, $CUDA_HOME/bin or /usr/local/cuda/bin, else from the
``nvidia-cuda-nvdisasm`` wheel, which the test extra installs (no CUDA toolkit needed).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

DEFAULT_OPS = ("R2UR", "ULOP3", "UIADD3", "UMOV", "HGMMA", "SEL", "SHFL", "STG")
DESCRIPTOR_MOVES = "R2UR before WGMMA"     # the column of descriptor_moves
WGMMA_LOOKBACK = 8                         # instructions before a WGMMA that descriptor_moves reads

# Run in a tree: build its programs (all MLA programs, or those named) and write each cubin into
# the folder given; prints [name, file] pairs as JSON.
BUILD_SCRIPT = """
import json, sys
from pathlib import Path
from flashmla_cupy import compiler, programs
names, out = sys.argv[1], Path(sys.argv[2])
chosen = [p for p in programs.mla_programs() if not names or p.name in names.split(";")]
if names and len(chosen) != len(names.split(";")):
    sys.exit("no such program among " + ", ".join(p.name for p in programs.mla_programs()))
pairs = []
for i, cubin in enumerate(compiler.build_many(chosen, "sm_90a", bundled=False)):
    path = out / f"{i:02d}.cubin"
    path.write_bytes(cubin.image)
    pairs.append([cubin.program.name, str(path)])
print(json.dumps(pairs))
"""

# An instruction line of nvdisasm: /*0a30*/  @!P0 UIADD3 UR4, UR5, 0x10, URZ ;
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def find_nvdisasm() -> str:
    """The nvdisasm binary's path; SystemExit saying where it was looked for if there is none."""
    candidates = [os.environ.get("NVDISASM"), shutil.which("nvdisasm")]
    candidates += [str(Path(home) / "bin" / "nvdisasm") for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda")
                   if home]
    try:
        import nvidia                                     # the namespace package of NVIDIA's wheels
        candidates += sorted(str(p) for root in nvidia.__path__ for p in Path(root).glob("*/bin/nvdisasm"))
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise SystemExit("nvdisasm not found ($NVDISASM, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, the "
                     "nvidia-cuda-nvdisasm wheel): pip install nvidia-cuda-nvdisasm")


def opcodes(sass: str) -> list[str]:
    """The opcodes of nvdisasm's listing in order, modifiers dropped (IMAD.MOV.U32 is IMAD)."""
    return [m.group(1) for m in map(_INSTRUCTION.search, sass.splitlines()) if m]


def opcode_counts(sass: str) -> Counter:
    """Instructions of nvdisasm's listing counted by opcode, and DESCRIPTOR_MOVES."""
    ops = opcodes(sass)
    return Counter(ops) + Counter({DESCRIPTOR_MOVES: descriptor_moves(ops)})


def descriptor_moves(ops: list[str]) -> int:
    """R2UR among the WGMMA_LOOKBACK instructions before each WGMMA (HGMMA, QGMMA, ...): operand
    descriptors made in vector registers and moved to the uniform ones for it (docs/perf-notes.md
    section 51)."""
    moves = set()
    for i, op in enumerate(ops):
        if op.endswith("GMMA"):
            moves.update(j for j in range(max(0, i - WGMMA_LOOKBACK), i) if ops[j] == "R2UR")
    return len(moves)


def disassemble(image: bytes, nvdisasm: str) -> str:
    """nvdisasm's listing of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(image)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def tree_counts(tree: Path, names: str, nvdisasm: str) -> dict[str, Counter]:
    """Per program of ``tree`` (in the registry's order), its opcode counts."""
    with tempfile.TemporaryDirectory(prefix="sass_mix_") as scratch:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
        built = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, names, scratch], cwd=tree, env=env,
                               capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(f"{tree}: building its programs failed:\n{built.stderr.strip()}")
        counts = {}
        for name, path in json.loads(built.stdout.strip().splitlines()[-1]):
            counts[name] = opcode_counts(disassemble(Path(path).read_bytes(), nvdisasm))
        return counts


def table_rows(labels: list[str], per_tree: list[dict[str, Counter]], ops: tuple[str, ...]) -> list[list[str]]:
    """[program, tree's label, instructions in all, DESCRIPTOR_MOVES, each op's count]: a row per
    program and tree, the trees of a program together; a program a tree lacks is left out there."""
    rows = []
    for name in dict.fromkeys(n for counts in per_tree for n in counts):
        for label, counts in zip(labels, per_tree):
            if name in counts:
                c = counts[name]
                instructions = sum(c.values()) - c[DESCRIPTOR_MOVES]
                rows.append([name, label, str(instructions), *(str(c[op]) for op in (DESCRIPTOR_MOVES, *ops))])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="*", help="directories with the package, or git revisions (default: this checkout)")
    ap.add_argument("--programs", default="", help='program names, ";"-separated (default: every MLA program)')
    ap.add_argument("--ops", default=",".join(DEFAULT_OPS), help="opcodes to count, comma separated")
    args = ap.parse_args(argv)
    # a sibling tool, imported here so that importing this module (tests/test_compiler.py does)
    # leaves sys.path as it was
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ab_profile import tree_of

    nvdisasm = find_nvdisasm()
    ops = tuple(op.strip().upper() for op in args.ops.split(",") if op.strip())
    with tempfile.TemporaryDirectory(prefix="sass_mix_trees_") as scratch:
        specs = args.trees or [str(Path(__file__).resolve().parent.parent)]
        trees = [tree_of(spec, Path(scratch) / str(i)) for i, spec in enumerate(specs)]
        per_tree = [tree_counts(tree, args.programs, nvdisasm) for tree in trees]

    from rich.table import Table

    from flashmla_cupy.cli import console

    labels = ["AB"[i] if len(specs) == 2 else str(i + 1) for i in range(len(specs))]
    table = Table(title=f"SASS instruction mix (sm_90a; {nvdisasm})",
                  caption="  ".join(f"{label}: {spec}" for label, spec in zip(labels, specs)))
    for header in ("program", "tree", "instructions", DESCRIPTOR_MOVES, *ops):
        table.add_column(header, justify="left" if header in ("program", "tree") else "right", no_wrap=True)
    for row in table_rows(labels, per_tree, ops):
        table.add_row(*row)
    console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
