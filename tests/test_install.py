"""Installing: the supported versions (pyproject.toml, .ci/oldest.txt and the import-time check
agree), the one-line errors for an unsupported environment, and the cubins shipped in the wheel
(found by the program's identity, never stale, used without NVRTC). CPU only, except the last
test (a driver that refuses a shipped cubin), which needs a Hopper GPU.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashmla_cupy import bundled, compiler, programs, versions

ROOT = Path(__file__).resolve().parent.parent
ARCH = "sm_90a"


def _release(version: str) -> tuple[int, ...]:
    """``"2.0"`` and ``"2.0.0"`` compare equal."""
    v = list(versions.parse(version))
    while v and v[-1] == 0:
        v.pop()
    return tuple(v)


def _pyproject_bounds() -> dict[str, list[tuple[str, str]]]:
    """``{group: [(distribution, lower bound)]}`` for the dependencies ("") and every extra."""
    text = (ROOT / "pyproject.toml").read_text()
    groups: dict[str, list[tuple[str, str]]] = {}
    project = text[text.index("[project]"):text.index("[project.scripts]")]
    for m in re.finditer(r'^(dependencies|[\w-]+)\s*=\s*\[(.*?)\]\s*$', project, re.S | re.M):
        name = "" if m.group(1) == "dependencies" else m.group(1)
        reqs = re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?((?:[<>=!~]=?[^",]+,?)*)"', m.group(2))
        groups[name] = [(dist, low.group(1)) for dist, spec in reqs
                        if (low := re.search(r">=\s*([\d.]+)", spec))]
    return groups


def _oldest_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def test_lower_bounds_match_the_import_check_and_the_oldest_ci_run():
    """pyproject.toml's lower bounds are the versions CI installs for its oldest run (dependencies,
    cu12, test and plot) and the ones `import flashmla_cupy` checks."""
    groups = _pyproject_bounds()
    assert {"", "cu12", "cu13", "test", "plot", "profile"} <= set(groups), groups
    pins = _oldest_pins()
    tested = [req for g in ("", "cu12", "test", "plot") for req in groups[g]]
    for dist, low in tested:
        assert _norm(dist) in pins, f".ci/oldest.txt pins no version of {dist} (pyproject: >={low})"
        assert _release(pins[_norm(dist)]) == _release(low), \
            f"{dist}: pyproject says >={low}, the oldest CI run installs {pins[_norm(dist)]}"
    bounds = {_norm(d): low for g in ("", "cu12") for d, low in groups[g]}
    cu13 = {_norm(d): low for d, low in groups["cu13"]}
    for dist, minimum in versions.MINIMUM.items():
        if dist == "cupy":
            for wheel, low in (("cupy-cuda12x", bounds["cupy-cuda12x"]), ("cupy-cuda13x", cu13["cupy-cuda13x"])):
                assert _release(low) == _release(minimum), wheel
        else:
            assert _release(bounds[_norm(dist)]) == _release(minimum), dist
    assert versions.parse(cu13["cuda-bindings"])[0] == versions.parse(cu13["cuda-toolkit"])[0] == 13


def test_each_cuda_extra_brings_one_cupy_and_parts_of_its_own_major():
    text = (ROOT / "pyproject.toml").read_text()
    for major, other in ((12, 13), (13, 12)):
        block = re.search(rf"^cu{major} = \[(.*?)\n\]", text, re.S | re.M).group(1)
        assert f"cupy-cuda{major}x" in block and f"cupy-cuda{other}x" not in block
        assert re.search(rf'"cuda-bindings>={major}[\d.]*,<{major + 1}"', block), block
        assert re.search(rf'"cuda-toolkit\[nvrtc,cudart\]>={major}[\d.]*,<{major + 1}"', block), block
    block = re.search(r"^dependencies = \[(.*?)\n\]", text, re.S | re.M).group(1)
    names = re.findall(r'^\s*"([A-Za-z0-9_.-]+)', block, re.M)
    assert names and not [n for n in names if n.startswith(("cupy", "cuda", "nvidia-cuda"))], names


# --------------------------------------------------------------------------------------------
# The check at import
# --------------------------------------------------------------------------------------------

GOOD = {"cupy-cuda12x": "14.2.0", "numpy": "2.3.0", "ml_dtypes": "0.5.1", "cuda-bindings": "12.9.4", "rich": "14.0.0"}


@pytest.fixture
def installed(monkeypatch):
    """Pretend these distributions (and only these) are installed."""
    found = dict(GOOD)
    monkeypatch.setattr(versions, "installed", lambda name: found.get(name))
    return found


@pytest.mark.parametrize("change, words", [
    ({"cupy-cuda12x": "13.3.0"}, ["CuPy (cupy-cuda12x) 13.3.0 is older than 14.0.1", "flashmla-cupy[cu12]"]),
    ({"cupy-cuda12x": "14.0.0"}, ["14.0.0 is older than 14.0.1"]),
    ({"cupy-cuda12x": None, "cupy-cuda13x": "13.6.0"}, ["cupy-cuda13x", "flashmla-cupy[cu13]"]),
    ({"cupy-cuda13x": "14.2.0"}, ["several CuPy packages", "cupy-cuda12x 14.2.0, cupy-cuda13x 14.2.0"]),
    ({"cupy-cuda12x": None, "cupy-cuda11x": "13.6.0"}, ["cupy-cuda11x is for CUDA 11", "[cu12]", "[cu13]"]),
    ({"numpy": "1.26.4"}, ["numpy 1.26.4 is older than 2.0", "pip install -U 'numpy>=2.0'"]),
    ({"ml_dtypes": "0.3.0"}, ["ml_dtypes 0.3.0 is older than 0.4"]),
    ({"cuda-bindings": "12.6.2"}, ["cuda-bindings 12.6.2 is older than 12.8", "flashmla-cupy[cu12]"]),
    ({"rich": "12.6.0"}, ["rich 12.6.0 is older than 13.0"]),
])
def test_unsupported_versions_are_named_in_one_line(installed, change, words):
    installed.update(change)
    problem = versions.environment_problem()
    assert problem and "\n" not in problem, problem
    for w in words:
        assert w in problem, problem


def test_missing_packages_are_named_in_one_line(installed, monkeypatch):
    assert versions.environment_problem() is None
    monkeypatch.setattr(versions, "_importable", lambda module: False)
    monkeypatch.setattr(versions.importlib.util, "find_spec", lambda name: None)
    del installed["cuda-bindings"]
    assert versions.environment_problem().startswith("cuda-bindings is not installed: pip install 'flashmla-cupy[cu12]'")
    del installed["cupy-cuda12x"]
    problem = versions.environment_problem()
    assert problem.startswith("CuPy is not installed") and "[cu12]" in problem and "[cu13]" in problem


def _path(site: Path) -> str:
    """PYTHONPATH with ``site`` (fake distributions) first, then this checkout, then the caller's."""
    return os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])


def _fake_distribution(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.mark.parametrize("command", [["-c", "import flashmla_cupy"], ["-m", "flashmla_cupy", "info"]])
def test_import_with_an_old_dependency_prints_one_line(tmp_path, command):
    """An old NumPy found first on the path (as an environment that kept one would have): one line
    on stderr, exit status 1, no traceback; the library and the command line alike."""
    _fake_distribution(tmp_path, "numpy", "1.26.4")
    env = dict(os.environ, PYTHONPATH=_path(tmp_path))
    r = subprocess.run([sys.executable, *command], capture_output=True, encoding="utf-8", env=env, cwd=tmp_path)
    assert r.returncode == 1, r
    assert r.stderr.strip().splitlines() == [
        "flashmla-cupy: numpy 1.26.4 is older than 2.0, the oldest that flashmla-cupy supports: "
        "pip install -U 'numpy>=2.0'"], r.stderr
    assert r.stdout == ""


def test_the_error_is_an_import_error_for_code_that_catches_it(tmp_path):
    _fake_distribution(tmp_path, "rich", "12.0.0")
    code = ("try:\n    import flashmla_cupy\nexcept ImportError as e:\n"
            "    print(type(e).__name__, e)\n")
    env = dict(os.environ, PYTHONPATH=_path(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, encoding="utf-8", env=env, cwd=tmp_path,
                       check=True)
    assert r.stdout.startswith("UnsupportedEnvironment rich 12.0.0 is older than 13.0"), r.stdout


def test_driver_problems_in_one_line(monkeypatch, installed):
    monkeypatch.setattr(versions, "driver_cuda_version", lambda: None)
    assert versions.driver_problem() == "no NVIDIA driver installed: libcuda.so.1 not found"
    monkeypatch.setattr(versions, "cupy_packages", lambda: {"cupy-cuda13x": "14.2.0"})
    monkeypatch.setattr(versions, "driver_cuda_version", lambda: 12020)
    problem = versions.driver_problem()
    assert "supports CUDA 12.2" in problem and ">= 580.65.06" in problem and "flashmla-cupy[cu12]" in problem
    monkeypatch.setattr(versions, "driver_cuda_version", lambda: 13000)
    assert versions.driver_problem() is None
    assert versions.install_command("profile") == "pip install 'flashmla-cupy[cu13,profile]'"


# --------------------------------------------------------------------------------------------
# Cubins shipped in the wheel
# --------------------------------------------------------------------------------------------



def test_identity_leaves_out_the_toolchain_but_not_sources_or_options(monkeypatch, tmp_path):
    """The shipped cubins' key: the same whatever NVRTC loads them, different after any edit
    under cuda_src/ or with extra options (so a stale cubin is never found)."""
    program = programs.metadata_program()
    monkeypatch.delenv("FLASHMLA_CUPY_EXTRA_OPTIONS", raising=False)
    monkeypatch.setattr(compiler, "toolchain", lambda: {"nvrtc": "12.9", "cutlass": "4.2.0"})
    monkeypatch.setattr(compiler, "nvrtc_cache_options", lambda: ["--no-cache"])
    identity, key = program.identity_key(ARCH), program.cache_key(ARCH)
    monkeypatch.setattr(compiler, "toolchain", lambda: {"nvrtc": "13.0", "cutlass": "4.2.0"})
    monkeypatch.setattr(compiler, "nvrtc_cache_options", lambda: [])
    assert program.identity_key(ARCH) == identity and program.cache_key(ARCH) != key
    assert program.identity_key("sm_100a") != identity
    monkeypatch.setenv("FLASHMLA_CUPY_EXTRA_OPTIONS", "-lineinfo")
    assert program.identity_key(ARCH) != identity
    monkeypatch.delenv("FLASHMLA_CUPY_EXTRA_OPTIONS")
    src = tmp_path / "src"
    shutil.copytree(compiler.source_dir(), src)
    monkeypatch.setattr(compiler, "source_dir", lambda: src)
    assert program.identity_key(ARCH) == identity
    (src / "common" / "pdl.cuh").write_text((src / "common" / "pdl.cuh").read_text() + "\n// edited\n")
    assert program.identity_key(ARCH) != identity


def test_a_source_checkout_ships_no_cubins():
    """tools/build_wheel.py compiles into a staged copy: a checkout (and `pip install .` from it)
    has no cubins and compiles on first use."""
    if Path(compiler.__file__).resolve().parent.parent != ROOT:
        pytest.skip(f"flashmla_cupy imported from {Path(compiler.__file__).parent}, not this checkout")
    assert not bundled.directory().exists()
    assert bundled.lookup(programs.metadata_program(), ARCH) is None


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A private bundled-cubin directory and cache, and no NVRTC: compiling raises."""
    folder = tmp_path / "cubins"
    monkeypatch.setattr(bundled, "directory", lambda: folder)
    monkeypatch.setattr(bundled, "_found", {})
    monkeypatch.setattr(compiler, "_memory", {})
    monkeypatch.setenv("FLASHMLA_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHMLA_CUPY_EXTRA_OPTIONS", raising=False)
    return folder


@pytest.mark.nvrtc
def test_shipped_cubins_are_used_without_nvrtc_and_never_when_stale(shipped, monkeypatch, tmp_path):
    program = programs.metadata_program()
    built = compiler.compile_program(program, ARCH)
    (path,) = bundled.write([built], shipped)
    assert path.name == bundled.file_name(program, ARCH, program.identity_key(ARCH))

    def no_nvrtc(*args, **kwargs):
        raise AssertionError("NVRTC was asked to compile")

    real_compile = compiler.compile_program
    monkeypatch.setattr(compiler, "compile_program", no_nvrtc)
    for cubin in (compiler.build(program, ARCH), compiler.build_many([program], ARCH)[0]):
        assert cubin.bundled and cubin.from_cache and cubin.image == built.image and cubin.path == path
        assert cubin.lowered == built.lowered and cubin.resources == built.resources
    assert not list((tmp_path / "cache").rglob("*.cubin"))          # nothing written to the cache

    # an edited header: the shipped cubin no longer matches, NVRTC compiles
    src = tmp_path / "src"
    shutil.copytree(compiler.source_dir(), src)
    (src / "mla" / "config.cuh").write_text((src / "mla" / "config.cuh").read_text() + "\n// edited\n")
    monkeypatch.setattr(compiler, "source_dir", lambda: src)
    assert bundled.lookup(program, ARCH) is None
    monkeypatch.setattr(compiler, "compile_program", real_compile)
    rebuilt = compiler.build(program, ARCH, status=False)
    assert not rebuilt.bundled and not rebuilt.from_cache


@pytest.mark.nvrtc
def test_a_shipped_cubin_is_checked_before_use(shipped):
    program, other = programs.metadata_program(), programs.combine_program("bf16")
    (path,) = bundled.write([compiler.compile_program(program, ARCH)], shipped)
    # another program's cubin under this one's name: its header's identity does not match
    (wrong,) = bundled.write([compiler.compile_program(other, ARCH)], shipped / "other")
    data = path.read_bytes()
    wrong.replace(path)
    assert bundled.lookup(program, ARCH) is None
    # a damaged file: a warning, then NVRTC
    path.write_bytes(data[:-100])
    with pytest.warns(compiler.CacheWarning, match="bundled cubin .* is unusable"):
        assert bundled.lookup(program, ARCH) is None
    path.write_bytes(data)
    assert bundled.lookup(program, ARCH).bundled


@pytest.mark.hopper
def test_a_driver_that_refuses_a_shipped_cubin_gets_one_from_nvrtc(shipped):
    """A shipped cubin the device cannot run (here: built for sm_80) makes the kernel compile."""
    import cupy

    from flashmla_cupy import attention, launch
    program = attention.PROGRAM
    foreign = compiler.compile_program(program, "sm_80")
    foreign.arch = ARCH
    bundled.write([foreign], shipped)
    assert bundled.lookup(program, ARCH).bundled
    kernel = launch.Kernel(program, program.kernels[0], cupy.cuda.runtime.getDevice(), ARCH)
    assert not kernel.cubin.bundled and kernel.cubin.image != foreign.image
