"""The NVRTC compile layer and its cubin cache (CPU only: no GPU needed)."""
from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashmla_cupy import compiler, programs

ARCH = "sm_90a"

_spec = importlib.util.spec_from_file_location("sass_mix", Path(__file__).resolve().parents[1] / "tools" / "sass_mix.py")
sass_mix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_mix)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private, empty cache directory (and no in-process memory of earlier builds)."""
    monkeypatch.setenv("FLASHMLA_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiler, "_memory", {})
    return tmp_path / "cache" / f"v{compiler.CACHE_FORMAT}"


@pytest.fixture(scope="module")
def mla_cubins(tmp_path_factory):
    """Every MLA program built once for this module, in parallel, into a private cache:
    ``(cubins, cache directory)``."""
    cache_dir = tmp_path_factory.mktemp("mla_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHMLA_CUPY_CACHE_DIR", str(cache_dir))
        mp.setattr(compiler, "_memory", {})
        return compiler.build_many(programs.mla_programs(), ARCH), cache_dir


def test_torch_is_not_imported():
    code = "import sys, flashmla_cupy; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cache_dir_respects_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASHMLA_CUPY_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiler.cache_dir() == tmp_path / "xdg" / "flashmla-cupy" / f"v{compiler.CACHE_FORMAT}"
    monkeypatch.setenv("FLASHMLA_CUPY_CACHE_DIR", str(tmp_path / "mine"))
    assert compiler.cache_dir() == tmp_path / "mine" / f"v{compiler.CACHE_FORMAT}"


def test_extra_options_reach_nvrtc_and_the_cache_key(monkeypatch):
    program = programs.metadata_program()
    monkeypatch.delenv("FLASHMLA_CUPY_EXTRA_OPTIONS", raising=False)
    key = program.cache_key(ARCH)
    assert "-lineinfo" not in program.options(ARCH)
    monkeypatch.setenv("FLASHMLA_CUPY_EXTRA_OPTIONS", " -lineinfo  -DFOO=1 ")
    n = len(compiler.BASE_OPTIONS)
    assert program.options(ARCH)[1:n + 3] == [*compiler.BASE_OPTIONS, "-lineinfo", "-DFOO=1"]
    assert program.cache_key(ARCH) != key


def test_ptxas_report_parser():
    log = textwrap.dedent("""\
        ptxas info    : Compiling entry function '_Z3fooi' for 'sm_90a'
        ptxas info    : Function properties for _Z3fooi
            344 bytes stack frame, 438 bytes spill stores, 600 bytes spill loads
        ptxas info    : Used 255 registers, used 1 barriers, 352 bytes cumulative stack size
        """)
    res = compiler.parse_ptxas_report(log, {"foo": "_Z3fooi", "bar": "_Z3barv"})
    assert (res["foo"].registers, res["foo"].stack_bytes, res["foo"].spill_stores, res["foo"].spill_loads,
            res["foo"].cumulative_stack_bytes) == (255, 344, 438, 600, 352)
    assert res["bar"] == compiler.KernelResources() and not res["bar"].spills_reported


@pytest.mark.nvrtc
def test_every_mla_kernel_compiles_for_sm90a_without_spills(mla_cubins, monkeypatch):
    """All MLA programs (both dtypes) to sm_90a cubins. Registers and stack come from the cubin
    (always there), spills from ptxas's report: a stack of 0 bytes, callees included, rules
    spills out even where a log had no report (spills live in the stack)."""
    cubins, cache_dir = mla_cubins
    # NVRTC 12.6-12.8's ptxas spills a few values of the FP8 kernels' warpgroups after their
    # register split (12.6.68: 88 B sparse, 40 B dense, 56 B e4m3 q, 24 B and 56 B
    # their one-token forms, 24 B the narrow kernel's WGMMA form; 0 from 12.9 on,
    # docs/perf-notes.md sections 14, 16, 17, 22, 42 and 46); bounded so that a regression (the
    # sparse kernel's old split: 416 B) fails.
    fp8_splitkv = [programs.splitkv_program(tag) for tag in (programs.SPARSE_FP8_TAG, programs.FP8_TAG,
                                                             programs.FP8_Q_TAG)]
    fp8_splitkv += [programs.splitkv_program(tag, one_token_pages=True) for tag in (programs.FP8_TAG,
                                                                                     programs.FP8_Q_TAG)]
    fp8_splitkv.append(programs.splitkv_program(programs.SPARSE_FP8_TAG, alone=True))
    old_ptxas_stack = {p.name: 96 for p in fp8_splitkv}
    old_ptxas_stack[programs.fp8_narrow_program().name] = 24
    for c in cubins:
        assert c.image[:4] == b"\x7fELF", c.program.name
        for name, res in c.resources.items():
            print(f"{c.program.name}: {res} ({c.compile_seconds:.1f} s)")
            assert res.registers > 0, f"{c.program.name}: no register count for {name} in the cubin"
            if c.program.name in old_ptxas_stack and compiler._nvrtc().getVersion() < (12, 9):
                assert res.cumulative_stack_bytes <= old_ptxas_stack[c.program.name], f"{name}: {res}"
                continue
            assert res.cumulative_stack_bytes == 0, (
                f"{name} uses {res.cumulative_stack_bytes} B of stack per thread ({res.stack_bytes} B its own "
                f"frame): register spills or a local array; ptxas says {res}")
            if res.spills_reported:
                assert (res.spill_stores, res.spill_loads) == (0, 0), f"{name} spills: {res}"
                reported = compiler.parse_ptxas_report(c.log, c.lowered)[name]
                assert (reported.registers, reported.stack_bytes) == (res.registers, res.stack_bytes), \
                    f"{name}: the cubin says {res}, ptxas {reported}"
    monkeypatch.setenv("FLASHMLA_CUPY_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(compiler, "_memory", {})
    again = compiler.build_many(programs.mla_programs(), ARCH)
    assert all(c.from_cache for c in again)


@pytest.mark.nvrtc
def test_the_16bit_kernel_makes_its_wgmma_descriptors_in_uniform_registers(mla_cubins):
    """No R2UR just before any WGMMA of the 16-bit cache's split-KV programs: their operand
    descriptors stay in uniform registers (NVRTC 12.6, 12.9 and 13.0 alike). Losing that shows in
    no register count and no spill, but cost 2-5 % on the GPU (a thread-0 shared store in the
    epilogue did it: docs/perf-notes.md section 51). nvdisasm comes with the test extra."""
    try:
        nvdisasm = sass_mix.find_nvdisasm()
    except SystemExit as e:
        pytest.skip(str(e))
    names = {programs.splitkv_program(tag, one_token_pages=tokens).name
             for tag in programs.DTYPE_TAGS for tokens in (False, True)}
    checked = [c for c in mla_cubins[0] if c.program.name in names]
    assert len(checked) == len(names) == 4
    for c in checked:
        sass = sass_mix.disassemble(c.image, nvdisasm)
        ops = sass_mix.opcodes(sass)
        moves = sass_mix.descriptor_moves(ops)
        # 0 with every NVRTC tested; a change that took the descriptors out had ~500 (one or more
        # a WGMMA): `python tools/sass_mix.py main HEAD` shows where
        assert ops.count("HGMMA") > 100 and moves <= 16, f"{c.program.name}: {moves} R2UR before its WGMMAs"


@pytest.mark.nvrtc
def test_every_compile_returns_the_ptxas_report():
    """NVRTC 12.9+ would answer the second compile from its own cache (where a driver is installed)
    without running ptxas, and log nothing; ``--no-cache`` keeps the report coming."""
    program = programs.metadata_program()
    for attempt in range(2):
        cubin = compiler.compile_program(program, ARCH)
        res = compiler.parse_ptxas_report(cubin.log, cubin.lowered)[program.kernels[0]]
        assert res.registers > 0 and res.spills_reported, f"compile {attempt + 1}: no ptxas report in {cubin.log!r}"


_STACK_KERNELS = r"""
__device__ __noinline__ float helper(const float* p, int i) {
    float a[32];
    for (int k = 0; k < 32; ++k) a[k] = p[k] * k;
    return a[i & 31];
}
extern "C" __global__ void calls_helper(const float* p, float* out, int i) {
    out[threadIdx.x] = helper(p, i + threadIdx.x);
}
extern "C" __global__ void no_stack(const float* p, float* out) { out[threadIdx.x] = 2.0f * p[threadIdx.x]; }
extern "C" __global__ void __launch_bounds__(1024, 2) spills(const float* p, float* out) {
    float v[96];
    #pragma unroll
    for (int k = 0; k < 96; ++k) v[k] = p[k * 1024 + threadIdx.x];
    float s = 0;
    #pragma unroll
    for (int r = 0; r < 4; ++r)
        #pragma unroll
        for (int k = 0; k < 96; ++k) s += v[k] * v[(k * 7 + r) % 96];
    out[threadIdx.x] = s;
}
"""


@pytest.mark.nvrtc
def test_cubin_resources_match_ptxas_report(tmp_path, monkeypatch):
    """The ELF reader agrees with ptxas's own report, kernel by kernel: MLA and FlashAttention
    kernels (no stack; records of every format) and small kernels with a stack frame, a callee's
    frame and register spills."""
    from flashmla_cupy import attention, cubin_info
    cubins = [compiler.compile_program(p, ARCH) for p in
              (programs.combine_program("bf16"), programs.metadata_program(), attention.PROGRAM)]
    (tmp_path / "stack.cu").write_text(_STACK_KERNELS)
    monkeypatch.setattr(compiler, "source_dir", lambda: tmp_path)
    cubins.append(compiler.compile_program(
        compiler.Program("stack", "stack.cu", ("calls_helper", "no_stack", "spills")), ARCH))
    for cubin in cubins:
        reported = compiler.parse_ptxas_report(cubin.log, cubin.lowered)
        found = cubin_info.kernel_resources(cubin.image)
        for expr, mangled in cubin.lowered.items():
            r = reported[expr]
            assert r.registers > 0, f"no ptxas report for {expr} in {cubin.log!r}"
            assert found[mangled] == {"registers": r.registers, "stack_bytes": r.stack_bytes,
                                      "cumulative_stack_bytes": r.cumulative_stack_bytes}, expr
            assert cubin.resources[expr] == r, expr
    stack = cubins[-1].resources
    assert stack["no_stack"].cumulative_stack_bytes == 0
    assert stack["calls_helper"].cumulative_stack_bytes >= 128          # helper's float[32]
    assert stack["spills"].stack_bytes > 0 and stack["spills"].spill_stores > 0


@pytest.mark.nvrtc
def test_resources_come_from_the_cubin_without_a_log(cache):
    """A cache entry whose log has no ptxas report (as NVRTC's own cache gave) still has registers
    and stack; spills are then unknown (-1)."""
    program = programs.combine_program("bf16")
    cubin = compiler.build(program, ARCH, status=False)
    res = compiler.kernel_resources(cubin.image, "", cubin.lowered)[program.kernels[0]]
    full = cubin.resources[program.kernels[0]]
    assert (res.registers, res.stack_bytes, res.cumulative_stack_bytes) == \
        (full.registers, full.stack_bytes, full.cumulative_stack_bytes)
    assert res.registers > 0 and not res.spills_reported and "spills not reported" in str(res)

    # `flashmla-cupy compile`'s table still shows registers and stack, and rules spills out.
    from rich.console import Console

    from flashmla_cupy.profiler import build as build_cmd
    cubin.resources = {program.kernels[0]: res}
    console = Console(record=True, width=160)
    console.print(build_cmd.resources_table([cubin], ARCH))
    row = next(line for line in console.export_text().splitlines() if "mla_combine_kernel" in line)
    assert f" {res.registers} " in row and "none (0 B stack)" in row and "?" not in row, row


@pytest.mark.nvrtc
def test_cubin_reader_refuses_other_bytes():
    from flashmla_cupy import cubin_info
    image = compiler.compile_program(programs.metadata_program(), ARCH).image
    with pytest.raises(cubin_info.CubinFormatError, match="not a 64-bit little-endian ELF"):
        cubin_info.kernel_resources(b"#!/bin/sh\necho not a cubin\n")
    with pytest.raises(cubin_info.CubinFormatError, match="cut short"):
        cubin_info.kernel_resources(image[: len(image) // 2])
    x86 = image[:0x12] + (62).to_bytes(2, "little") + image[0x14:]          # EM_X86_64
    with pytest.raises(cubin_info.CubinFormatError, match="machine 62, not a CUDA cubin"):
        cubin_info.kernel_resources(x86)


@pytest.mark.nvrtc
def test_cache_hit_and_invalidation_on_header_edit(cache, tmp_path, monkeypatch):
    program = programs.metadata_program()
    first = compiler.build(program, ARCH, status=False)
    assert not first.from_cache and first.path is not None and first.path.parent == cache
    monkeypatch.setattr(compiler, "_memory", {})
    second = compiler.build(program, ARCH, status=False)
    assert second.from_cache and second.image == first.image

    # Editing any header under cuda_src/ (here: one the program does not even include) changes the key.
    src = tmp_path / "src"
    shutil.copytree(compiler.source_dir(), src)
    monkeypatch.setattr(compiler, "source_dir", lambda: src)
    key_before = program.cache_key(ARCH)
    (src / "common" / "pdl.cuh").write_text((src / "common" / "pdl.cuh").read_text() + "\n// edited\n")
    assert program.cache_key(ARCH) != key_before
    monkeypatch.setattr(compiler, "_memory", {})
    third = compiler.build(program, ARCH, status=False)
    assert not third.from_cache


@pytest.mark.nvrtc
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupted_entry_is_detected_and_rebuilt(cache, monkeypatch, damage):
    program = programs.metadata_program()
    path = compiler.build(program, ARCH, status=False).path
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    monkeypatch.setattr(compiler, "_memory", {})
    with pytest.warns(compiler.CacheWarning, match="unusable"):
        rebuilt = compiler.build(program, ARCH, status=False)
    assert not rebuilt.from_cache
    compiler.read_entry(path)  # valid again


@pytest.mark.nvrtc
def test_read_only_cache_falls_back_with_a_warning(cache, monkeypatch):
    cache.mkdir(parents=True)
    cache.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setattr(compiler, "_warned_readonly", False)
    try:
        if os.access(cache, os.W_OK):  # root ignores permissions: make the write fail as EROFS would
            def read_only(*args, **kwargs):
                raise OSError(errno.EROFS, "Read-only file system")
            monkeypatch.setattr(compiler.tempfile, "mkstemp", read_only)
        with pytest.warns(compiler.CacheWarning, match="cannot write"):
            cubin = compiler.build(programs.metadata_program(), ARCH, status=False)
        assert cubin.image[:4] == b"\x7fELF" and cubin.path is None
    finally:
        cache.chmod(stat.S_IRWXU)


@pytest.mark.nvrtc
def test_concurrent_compiles_leave_one_valid_entry(cache, tmp_path):
    code = textwrap.dedent("""\
        from flashmla_cupy import compiler, programs
        compiler.build(programs.metadata_program(), "sm_90a", status=False)
        """)
    env = dict(os.environ, FLASHMLA_CUPY_CACHE_DIR=str(cache.parent))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(4)]
    assert all(p.wait() == 0 for p in procs)
    entries = list(cache.glob("*.cubin"))
    assert len(entries) == 1
    header, image = compiler.read_entry(entries[0])
    assert header["program"] == "mla_metadata" and image[:4] == b"\x7fELF"
    assert not list(cache.glob("*.tmp"))


def test_installed_layout_finds_its_device_sources(tmp_path):
    """A non-editable install puts cuda_src/ inside the package (pyproject's package-dir)."""
    site = tmp_path / "site"
    shutil.copytree(compiler.source_dir().parent / "flashmla_cupy", site / "flashmla_cupy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(compiler.source_dir(), site / "flashmla_cupy" / "cuda_src")
    code = "from flashmla_cupy import compiler; print(compiler.source_dir())"
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path, env=env)
    assert out.stdout.strip() == str(site / "flashmla_cupy" / "cuda_src")
