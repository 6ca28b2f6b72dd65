"""Registers and stack frames of the kernels in a cubin, read from the cubin itself.

ptxas's ``-v`` report in NVRTC's program log is the usual source, but NVRTC does not always return
it (seen on the lent H200 for the small metadata program, while the same NVRTC version elsewhere
did); the cubin always carries the facts. A cubin is an ELF file whose ``.nv.info`` sections hold
attribute records, each ``(format: u8, attribute: u8)`` followed by a ``u16`` value (format 3), or
a ``u16`` size and that many bytes (format 4), or nothing (format 1) or one byte (format 2). The
global ``.nv.info`` section holds, per kernel symbol, ``EIATTR_REGCOUNT`` and
``EIATTR_FRAME_SIZE`` as ``(symbol index: u32, value: u32)`` payloads.

A stack frame of 0 bytes means no spills (a spill needs local memory); spill byte counts
themselves appear only in ptxas's report.
"""
from __future__ import annotations

import struct

EIATTR_FRAME_SIZE = 0x11
EIATTR_REGCOUNT = 0x2F
_FORMAT_SIZES = {1: 0, 2: 1}          # formats without a size field: payload bytes
_HVAL, _SVAL = 3, 4


class CubinFormatError(ValueError):
    """The bytes are not a 64-bit little-endian ELF cubin."""


def _sections(image: bytes) -> list[tuple[str, int, int, int, int]]:
    """(name, type, offset, size, link) of every section."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise CubinFormatError("not a 64-bit little-endian ELF file (a cubin)")
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx]
    name_base = names[4]

    def name(offset: int) -> str:
        end = image.index(b"\0", name_base + offset)
        return image[name_base + offset:end].decode()

    return [(name(h[0]), h[1], h[4], h[5], h[6]) for h in headers]


def _symbol_names(image: bytes, sections) -> dict[int, str]:
    """Symbol index -> name, from the symbol table (.symtab) and its string table."""
    for name, kind, offset, size, link in sections:
        if kind == 2:                                   # SHT_SYMTAB
            strings = sections[link][2]
            out = {}
            for index in range(size // 24):
                name_offset, = struct.unpack_from("<I", image, offset + index * 24)
                end = image.index(b"\0", strings + name_offset)
                out[index] = image[strings + name_offset:end].decode()
            return out
    return {}


def _attributes(image: bytes, offset: int, size: int):
    """(attribute, payload bytes) of every record in one .nv.info section."""
    pos, end = offset, offset + size
    while pos + 2 <= end:
        fmt, attr = image[pos], image[pos + 1]
        pos += 2
        if fmt == _HVAL:
            yield attr, image[pos:pos + 2]
            pos += 2
        elif fmt == _SVAL:
            length, = struct.unpack_from("<H", image, pos)
            yield attr, image[pos + 2:pos + 2 + length]
            pos += 2 + length
        elif fmt in _FORMAT_SIZES:
            yield attr, image[pos:pos + _FORMAT_SIZES[fmt]]
            pos += _FORMAT_SIZES[fmt]
        else:
            raise CubinFormatError(f"unknown .nv.info record format {fmt}")


def kernel_resources(image: bytes) -> dict[str, dict[str, int]]:
    """``{mangled kernel name: {"registers": n, "stack_bytes": n}}`` for every kernel."""
    sections = _sections(image)
    symbols = _symbol_names(image, sections)
    found: dict[str, dict[str, int]] = {}
    for name, _, offset, size, _ in sections:
        if name != ".nv.info":
            continue
        for attr, payload in _attributes(image, offset, size):
            if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and len(payload) == 8:
                symbol, value = struct.unpack("<II", payload)
                key = "registers" if attr == EIATTR_REGCOUNT else "stack_bytes"
                found.setdefault(symbols.get(symbol, f"symbol {symbol}"), {})[key] = value
    return found
