"""tools/sass_mix.py, the SASS instruction mix of the kernels (CPU: nvdisasm's listing parsed from a
fixed text; the whole tool where nvdisasm is installed)."""
from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sass_mix", REPO / "tools" / "sass_mix.py")
sass_mix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_mix)

LISTING = """\
        .text._ZN8flashmla18splitkv_mla_kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_12:
        /*0020*/              @!P0 BRA `(.L_x_13) ;
        /*0030*/               @P1 IMAD.MOV.U32 R4, RZ, RZ, R5 ;
        /*0040*/                   R2UR UR4, R2 ;
        /*0050*/             @UP0 UIADD3 UR5, UR4, 0x10, URZ ;
        /*0060*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4].tnspB, R24 ;
        /*0070*/                   IMAD.WIDE R6, R0, 0x4, R6 ;
        /*0080*/                   EXIT ;
"""


def test_counts_opcodes_without_modifiers_or_predicates():
    assert sass_mix.opcode_counts(LISTING) == Counter(
        {"LDC": 1, "S2R": 1, "BRA": 1, "IMAD": 2, "R2UR": 1, "UIADD3": 1, "HGMMA": 1, "EXIT": 1,
         sass_mix.DESCRIPTOR_MOVES: 1})


def test_descriptor_moves_are_the_r2ur_shortly_before_a_wgmma():
    far = ["R2UR"] + ["IMAD"] * sass_mix.WGMMA_LOOKBACK + ["HGMMA"]
    assert sass_mix.descriptor_moves(far) == 0
    near = ["R2UR", "R2UR", "UIADD3", "QGMMA", "R2UR", "HGMMA", "HGMMA"]
    assert sass_mix.descriptor_moves(near) == 3          # each counted once, for every WGMMA kind
    assert sass_mix.descriptor_moves(["R2UR", "FMUL", "STG"]) == 0


def test_rows_keep_a_programs_trees_together():
    moves = sass_mix.DESCRIPTOR_MOVES
    a = {"k": Counter({"R2UR": 2, "FMUL": 8, moves: 1}), "m": Counter({"SEL": 1})}
    b = {"k": Counter({"R2UR": 9, "FMUL": 8, moves: 5})}
    assert sass_mix.table_rows(["A", "B"], [a, b], ("R2UR", "SEL")) == [
        ["k", "A", "10", "1", "2", "0"], ["k", "B", "17", "5", "9", "0"], ["m", "A", "1", "0", "0", "1"]]


def test_without_nvdisasm_it_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("NVDISASM", raising=False)
    monkeypatch.setattr(sass_mix.os.path, "isfile", lambda p: False)
    with pytest.raises(SystemExit, match="pip install nvidia-cuda-nvdisasm"):
        sass_mix.find_nvdisasm()


@pytest.mark.nvrtc
def test_the_tool_counts_a_built_program(capsys):
    try:
        sass_mix.find_nvdisasm()
    except SystemExit:
        pytest.skip("no nvdisasm here (pip install nvidia-cuda-nvdisasm)")
    counts = sass_mix.tree_counts(REPO, "mla_metadata", sass_mix.find_nvdisasm())
    assert list(counts) == ["mla_metadata"]
    assert counts["mla_metadata"]["EXIT"] >= 1 and sum(counts["mla_metadata"].values()) > 100
    assert sass_mix.main([str(REPO), "--programs", "mla_metadata", "--ops", "exit"]) == 0
    out = capsys.readouterr().out
    assert "mla_metadata" in out and "EXIT" in out


def test_an_unknown_program_is_an_error():
    with pytest.raises(SystemExit, match="no such program"):
        sass_mix.tree_counts(REPO, "no_such_program", "nvdisasm")
