"""The NVRTC compile layer and its cubin cache (CPU only: no GPU needed)."""
from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from flashmla_cupy import compiler, programs

ARCH = "sm_90a"


def _nvrtc_reason() -> str | None:
    try:
        compiler._nvrtc().getVersion()
        compiler.include_dirs()
    except Exception as e:
        return f"NVRTC or headers unavailable: {type(e).__name__}: {e}"
    return None


needs_nvrtc = pytest.mark.skipif(_nvrtc_reason() is not None, reason=_nvrtc_reason() or "")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private, empty cache directory (and no in-process memory of earlier builds)."""
    monkeypatch.setenv("FLASHMLA_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiler, "_memory", {})
    return tmp_path / "cache" / f"v{compiler.CACHE_FORMAT}"


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
        ptxas info    : Used 255 registers, used 1 barriers
        """)
    res = compiler.parse_ptxas_report(log, {"foo": "_Z3fooi"})["foo"]
    assert (res.registers, res.stack_bytes, res.spill_stores, res.spill_loads) == (255, 344, 438, 600)


@needs_nvrtc
def test_every_mla_kernel_compiles_for_sm90a_without_spills(cache):
    """All MLA programs (both dtypes) to sm_90a cubins, in parallel. Registers and stack come from
    the cubin (always there); spills from ptxas's report where NVRTC returned one (not always:
    see cubin_info), and a 0-byte stack frame rules them out anyway."""
    cubins = compiler.build_many(programs.mla_programs(), ARCH)
    for c in cubins:
        assert c.image[:4] == b"\x7fELF", c.program.name
        for name, res in c.resources.items():
            print(f"{c.program.name}: {res} ({c.compile_seconds:.1f} s)")
            assert res.registers > 0, f"no register count for {name}"
            assert res.stack_bytes == 0, f"{name} has a {res.stack_bytes}-byte stack frame (spills or local arrays)"
            assert res.spill_stores <= 0 and res.spill_loads <= 0, f"{name} spills: {res}"
    again = compiler.build_many(programs.mla_programs(), ARCH)
    assert all(c.from_cache for c in again)


@needs_nvrtc
def test_cubin_resources_match_ptxas_report(cache):
    """The ELF reader agrees with ptxas's own report, kernel by kernel."""
    from flashmla_cupy import cubin_info
    cubin = compiler.build(programs.combine_program("bf16"), ARCH, status=False)
    reported = compiler.parse_ptxas_report(cubin.log, cubin.lowered)
    found = cubin_info.kernel_resources(cubin.image)
    if any(r.registers < 0 for r in reported.values()):
        pytest.skip("this NVRTC returned no ptxas report to compare with (as on the lent GPU machines)")
    for expr, mangled in cubin.lowered.items():
        assert found[mangled] == {"registers": reported[expr].registers, "stack_bytes": reported[expr].stack_bytes}


def test_cubin_reader_refuses_other_bytes():
    from flashmla_cupy import cubin_info
    with pytest.raises(cubin_info.CubinFormatError, match="not a 64-bit little-endian ELF"):
        cubin_info.kernel_resources(b"#!/bin/sh\necho not a cubin\n")


@needs_nvrtc
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


@needs_nvrtc
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


@needs_nvrtc
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


@needs_nvrtc
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
