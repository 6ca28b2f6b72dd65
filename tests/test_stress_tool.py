"""tools/stress.py on the CPU: the cache lengths it draws and how the parent counts its processes'
results (the calls themselves need a Hopper GPU: the tool is run there)."""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("stress", REPO / "tools" / "stress.py")
stress = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stress)


def test_fixed_lengths_are_s_k_for_every_request():
    lens = stress.cache_lengths(np.random.default_rng(0), 128, 16384, fixed=True)
    assert lens.shape == (128,) and (lens == 16384).all()


def test_random_lengths_include_empty_requests_and_ones_shorter_than_s_q():
    lens = stress.cache_lengths(np.random.default_rng(1), 20000, 4096, fixed=False)
    assert lens.min() == 0 and (lens >= 0).all()
    empty = (lens == 0).mean()
    assert 0.015 < empty < 0.03                       # P(N(s_k, s_k / 2) < 0) = 2.3 %
    assert ((lens > 0) & (lens < 64)).sum() > 10      # shorter than some s_q: rows that see nothing
    assert abs(np.median(lens) - 4096) < 100
    again = stress.cache_lengths(np.random.default_rng(1), 20000, 4096, fixed=False)
    assert (again == lens).all()                      # a process's seed replays its lengths


def test_the_parent_counts_failures_hangs_and_passes_its_options(monkeypatch, capsys):
    outcomes = iter(["ok", "FAILED s_k 4096 h_q 8 s_q 1: 3 outputs ... differ", "hang", "ok"])
    commands = []

    def fake_run(cmd, capture_output, text, timeout):
        commands.append(cmd)
        outcome = next(outcomes)
        if outcome == "hang":
            raise subprocess.TimeoutExpired(cmd, timeout)
        return subprocess.CompletedProcess(cmd, 0, stdout=f"{outcome}\n", stderr="")

    monkeypatch.setattr(stress.subprocess, "run", fake_run)
    monkeypatch.setattr("sys.argv", ["stress.py", "--processes", "4", "--dtype", "bf16", "--lengths", "fixed",
                                     "--shapes", "16384x64x1", "--timeout", "7", "--seed", "10"])
    assert stress.main() == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "seed 10: ok" and out[1].startswith("seed 11: FAILED s_k 4096")
    assert out[2] == "seed 12: FAILED: no result within 7 s (a hang?)"
    assert out[-1] == "2 of 4 processes failed"
    for seed, cmd in zip(range(10, 14), commands):
        options = dict(zip(cmd[2::2], cmd[3::2]))
        assert options["--child"] == str(seed) and options["--lengths"] == "fixed"
        assert options["--dtype"] == "bf16" and options["--shapes"] == "16384x64x1"


def test_a_child_that_prints_nothing_is_a_failure(monkeypatch, capsys):
    monkeypatch.setattr(stress.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, -6, stdout="", stderr="Fatal Python error: Aborted\n"))
    monkeypatch.setattr("sys.argv", ["stress.py", "--processes", "1"])
    assert stress.main() == 1
    assert "seed 0: FAILED: exited without a result (Fatal Python error: Aborted)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--lengths", "sometimes"], ["--dtype", "int8"]])
def test_bad_options_are_refused(monkeypatch, argv):
    monkeypatch.setattr("sys.argv", ["stress.py", *argv])
    with pytest.raises(SystemExit):
        stress.main()
