"""Host parameter structs (flashmla_cupy/params.py) against their C++ definitions (params.cuh)."""
from __future__ import annotations

import ctypes
import re

import pytest

from flashmla_cupy import compiler, params

C_TYPES = {
    "TensorMap": params.TensorMap,
    "int": ctypes.c_int32,
    "float": ctypes.c_float,
    "int64_t": ctypes.c_int64,
}


def parse_structs(text: str) -> dict[str, list[tuple[str, str]]]:
    """struct name -> [(C type, field name)] for the one-field-per-line structs of params.cuh."""
    structs = {}
    for name, body in re.findall(r"struct (\w+) \{(.*?)\n\};", text, re.S):
        fields = []
        for line in body.splitlines():
            line = line.split("//")[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"(const\s+)?([\w:]+)\s*(\*?)\s*(\w+);", line)
            assert m, f"unparsable field line in {name}: {line!r}"
            fields.append((m.group(2) + m.group(3), m.group(4)))
        structs[name] = fields
    return structs


@pytest.mark.parametrize("struct", [params.SplitKVParams, params.CombineParams, params.MetadataParams])
def test_host_struct_matches_device_header(struct):
    header = (compiler.source_dir() / "mla" / "params.cuh").read_text()
    device_fields = parse_structs(header)[struct.__name__]
    host_fields = struct._fields_
    assert [n for _, n in device_fields] == [n for n, _ in host_fields], "field names or order differ"
    for (ctype, name), (_, host_type) in zip(device_fields, host_fields):
        if ctype.endswith("*"):
            assert host_type is ctypes.c_uint64, f"{name}: pointer must be 64-bit on the host"
        else:
            assert host_type is C_TYPES[ctype], f"{name}: {ctype} vs {host_type}"


def test_parser_rejects_a_changed_header():
    text = "struct SplitKVParams {\n    int batch;\n    float s_q;\n};"
    fields = parse_structs(text)["SplitKVParams"]
    assert fields == [("int", "batch"), ("float", "s_q")]
    with pytest.raises(AssertionError):
        parse_structs("struct X {\n    int a, b;\n};")


def test_device_sizes_are_padded_for_tensor_maps():
    size = params.device_sizeof(params.SplitKVParams)
    assert size % 64 == 0 and size >= ctypes.sizeof(params.SplitKVParams)
    assert params.device_sizeof(params.MetadataParams) == ctypes.sizeof(params.MetadataParams)
    defines = dict(params.layout_defines())
    assert defines["FLASHMLA_SPLITKV_PARAMS_BYTES"] == str(size)


# --- constants shared with the device code (flashmla_cupy/constants.py) ------------------------

def test_every_mla_program_gets_every_shared_constant():
    from flashmla_cupy import constants, programs
    shared = dict(constants.defines())
    assert shared["FLASHMLA_HEAD_DIM_K"] == "576" and shared["FLASHMLA_COMBINE_WARPS"] == "8"
    for program in programs.mla_programs():
        defines = dict(program.defines)
        assert {k: defines.get(k) for k in shared} == shared, program.name


def test_device_code_takes_shared_constants_from_the_defines_only():
    """config.cuh defines each constant from its FLASHMLA_* macro (and refuses to compile without
    them); no MLA source spells one of the shared sizes as a literal constexpr of its own."""
    import re

    from flashmla_cupy import constants
    config = (compiler.source_dir() / "mla" / "config.cuh").read_text()
    for name, _ in constants.defines():
        if not name.startswith("FLASHMLA_ERROR_"):
            assert re.search(rf"constexpr int k\w+ = {name};", config), f"config.cuh does not use {name}"
    assert "#error" in config and "FLASHMLA_HEAD_DIM_K" in config
    for path in (compiler.source_dir() / "mla").glob("*.cu*"):
        text = path.read_text()
        assert not re.search(r"constexpr int k\w+ = (576|512|64|256|8);", text), f"{path.name} redefines a shared constant"
