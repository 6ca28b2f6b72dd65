"""The command line's handling of mistakes and of pipes (CPU only): unknown commands, bad
targets, the no-driver message, and output that stays in order without bars or padding when
stdout and stderr are not terminals."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashmla_cupy import cli, versions

ROOT = Path(__file__).resolve().parent.parent




@pytest.mark.parametrize("word, suggestion", [("complie", "compile"), ("infoo", "info"), ("atention", "attention"),
                                              ("sprase", "sparse"), ("xyz", None)])
def test_an_unknown_command_is_an_error_with_a_suggestion(capsys, word, suggestion):
    with pytest.raises(SystemExit) as excinfo:
        cli.main([word, "--arch", "sm_90a"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown command {word!r}" in err and "commands: profile, compile, info" in err
    assert (f"did you mean {suggestion!r}?" in err) if suggestion else "did you mean" not in err
    assert "invalid choice" not in err


@pytest.mark.parametrize("argv, what", [([], "mla"), (["--quick"], "mla"), (["mla", "--quick"], "mla"),
                                        (["attention"], "attention"), (["profile", "attention"], "attention"),
                                        (["sparse"], "sparse"), (["profile", "sparse", "--quick"], "sparse"),
                                        (["profile", "--topk", "128,256", "sparse"], "sparse")])
def test_without_a_command_flashmla_cupy_profiles(monkeypatch, argv, what):
    seen = []
    monkeypatch.setattr(cli, "cmd_profile", lambda args: seen.append(args.what) or 0)
    assert cli.main(argv) == 0 and seen == [what]


@pytest.mark.parametrize("text, sizes", [("1,16,128", [1, 16, 128]), ("64", [64]), ("512, 2", [512, 2])])
def test_page_size_takes_powers_of_two(monkeypatch, text, sizes):
    seen = []
    monkeypatch.setattr(cli, "cmd_profile", lambda args: seen.append(args.page_sizes) or 0)
    assert cli.main(["--quick", "--page-size", text]) == 0 and seen == [sizes]


@pytest.mark.parametrize("text", ["0", "3", "48", "16,48", "-64", "x", ""])
def test_page_size_rejects_what_is_not_a_power_of_two(capsys, text):
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", "--page-size", text])
    assert excinfo.value.code == 2
    assert (f"argument --page-size: expected powers of two (1, 2, 4, ..., 64, 128, 256, ...), got {text!r}"
            in capsys.readouterr().err)


def test_page_sizes_reach_the_grid_and_default_to_the_seeds_64():
    from flashmla_cupy.profiler import shapes

    parse = cli.build_parser().parse_args
    assert cli._mla_shapes(parse(["profile", "--quick"])) == shapes.quick_grid()
    assert cli._mla_shapes(parse(["profile"])) == shapes.mla_grid()
    assert {s.page_size for s in shapes.mla_grid()} == {64}
    quick = cli._mla_shapes(parse(["profile", "--quick", "--page-size", "16,256"]))
    assert [(s.key, s.page_size) for s in quick] == [(k, p) for k in shapes.QUICK_KEYS for p in (16, 256)]
    grid = cli._mla_shapes(parse(["profile", "--seqlens", "512", "--heads", "16", "--page-size", "1,128"]))
    assert [(s.s_q, s.varlen, s.page_size) for s in grid] == [
        (1, False, 1), (1, False, 128), (1, True, 1), (1, True, 128),
        (2, False, 1), (2, False, 128), (2, True, 1), (2, True, 128)]


def test_dtype_fp8_reaches_the_grid():
    """--dtype takes the dense FP8 cache beside bf16 and fp16; every shape carries it."""
    from flashmla_cupy.profiler import shapes

    parse = cli.build_parser().parse_args
    for dtype in ("bf16", "fp16", "fp8"):
        quick = cli._mla_shapes(parse(["profile", "--quick", "--dtype", dtype]))
        assert quick == shapes.quick_grid(dtype=dtype) and {s.dtype for s in quick} == {dtype}
    assert parse(["profile"]).dtype == "bf16"


def test_q_dtype_reaches_the_grid():
    """--q-dtype sets q's dtype in every shape; without it q's is the cache's (bf16 over the FP8 one)."""
    from flashmla_cupy.profiler import shapes

    parse = cli.build_parser().parse_args
    for argv, q_dtype in ((["--dtype", "fp8", "--q-dtype", "fp8"], "fp8"), (["--dtype", "fp8"], "bf16"),
                          (["--dtype", "fp8", "--q-dtype", "bf16"], "bf16"), (["--dtype", "fp16"], "fp16"),
                          (["--dtype", "fp16", "--q-dtype", "fp16"], "fp16")):
        quick = cli._mla_shapes(parse(["profile", "--quick", *argv]))
        assert quick == shapes.quick_grid(dtype=argv[1], q_dtype=q_dtype)
        assert {s.q_dtype for s in quick} == {q_dtype}
    grid = cli._mla_shapes(parse(["profile", "--seqlens", "512", "--heads", "16", "--dtype", "fp8",
                                  "--q-dtype", "fp8"]))
    assert len(grid) == 4 and {(s.dtype, s.q_dtype) for s in grid} == {("fp8", "fp8")}
    assert parse(["profile"]).q_dtype is None


@pytest.mark.parametrize("q_dtype", ["e4m3", "fp32", "FP8"])
def test_q_dtype_rejects_what_the_kernels_do_not_take(capsys, q_dtype):
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", "--dtype", "fp8", "--q-dtype", q_dtype])
    assert excinfo.value.code == 2
    assert "argument --q-dtype: invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["fp32", "e4m3", "FP8"])
def test_dtype_rejects_what_the_kernels_do_not_take(capsys, dtype):
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", "--dtype", dtype])
    assert excinfo.value.code == 2
    assert "argument --dtype: invalid choice" in capsys.readouterr().err


def test_compile_rejects_what_is_not_an_sm_target(capsys):
    for bad in ("foo", "90a", "sm90a", "sm_9", "compute_90a"):
        with pytest.raises(SystemExit) as excinfo:
            cli.main(["compile", "--arch", bad, "--list"])
        assert excinfo.value.code == 2
        assert f"expected an SM target such as sm_90a, got {bad!r}" in capsys.readouterr().err


@pytest.mark.nvrtc
def test_compile_rejects_a_target_that_nvrtc_does_not_build():
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["compile", "--arch", "sm_20", "--list"])
    code = excinfo.value.code
    assert isinstance(code, str) and "\n" not in code
    assert code.startswith("flashmla-cupy compile: --arch sm_20: NVRTC ") and "sm_90" in code


def test_no_driver_is_said_so(monkeypatch):
    """CUDA reports a missing driver as an insufficient one; the message names the real cause."""
    import cupy

    def insufficient():
        raise cupy.cuda.runtime.CUDARuntimeError(35)     # cudaErrorInsufficientDriver

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", insufficient)
    monkeypatch.setattr(versions, "driver_cuda_version", lambda: None)
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["profile", "--quick"])
    code = excinfo.value.code
    assert "no NVIDIA driver installed: libcuda.so.1 not found" in code and "insufficient" not in code
    assert "\n" not in code


def test_info_in_a_pipe_is_plain_lines(capsys, monkeypatch):
    import cupy

    def insufficient():
        raise cupy.cuda.runtime.CUDARuntimeError(35)

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", insufficient)
    monkeypatch.setattr(versions, "driver_cuda_version", lambda: None)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert not [line for line in lines if line != line.rstrip()], "trailing padding"
    gpu = next(line for line in lines if line.startswith("GPU"))
    assert "no NVIDIA driver installed" in gpu
    assert any(line.startswith("bundled cubins") for line in lines)
    assert any(line.startswith("CUDA driver API") and "no NVIDIA driver" in line for line in lines)


@pytest.mark.nvrtc
def test_compile_in_a_pipe_keeps_its_order_without_bars(tmp_path):
    """stdout and stderr into one pipe, as in `flashmla-cupy compile 2>&1 | tee log`: the header,
    each program as it finishes, then the table and the summary; no progress bar."""
    env = dict(os.environ, FLASHMLA_CUPY_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("COLUMNS", None)
    r = subprocess.run([sys.executable, "-m", "flashmla_cupy", "compile", "--arch", "sm_90a", "--only", "metadata"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, encoding="utf-8", env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    order = [next(i for i, line in enumerate(lines) if text in line)
             for text in ("building 1 program(s) for sm_90a", "mla_metadata: compiled in", "mla_metadata_kernel",
                          "1 program(s): 0 bundled, 0 cache hit(s), 1 compiled")]
    assert order == sorted(order), r.stdout
    assert "kernel program(s) for sm_90a" not in r.stdout, r.stdout     # the progress bar's own line
