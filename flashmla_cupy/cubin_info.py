"""Registers and stack of the kernels in a cubin, read from the cubin itself.

ptxas's ``-v`` report in NVRTC's program log is the other source, but it is missing whenever ptxas
did not run: NVRTC 12.9+ answers a repeated compile from its own cache (kept in the driver's
compute cache, so only where a driver is installed) and then logs nothing. ``compiler`` turns that
cache off; the cubin carries the facts either way.

A cubin is a 64-bit little-endian ELF file (machine ``EM_CUDA``). Its ``.nv.info`` sections (the
global one, and one ``.nv.info.<kernel>`` per kernel) hold attribute records: ``format: u8``,
``attribute: u8`` and a 2-byte field, which is unused (format 1: no value), a byte and a pad byte
(2), a ``u16`` value (3), or the ``u16`` size of a payload that follows (4). The ones read here
have a payload ``(symbol index: u32, value: u32)``:

* ``EIATTR_REGCOUNT`` (0x2f): registers per thread;
* ``EIATTR_FRAME_SIZE`` (0x11): the function's own stack frame (ptxas's "bytes stack frame");
* ``EIATTR_MIN_STACK_SIZE`` (0x12) / ``EIATTR_MAX_STACK_SIZE`` (0x23): the stack with the frames
  of the functions it calls (ptxas's "cumulative stack size").

Spill byte counts appear only in ptxas's report, but spills live in the stack: a kernel whose
stack, callees included, is 0 bytes does not spill.
"""
from __future__ import annotations

import struct

EM_CUDA = 190
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F
_KEYS = {EIATTR_REGCOUNT: "registers", EIATTR_FRAME_SIZE: "stack_bytes",
         EIATTR_MIN_STACK_SIZE: "cumulative_stack_bytes", EIATTR_MAX_STACK_SIZE: "cumulative_stack_bytes"}
_NVAL, _BVAL, _HVAL, _SVAL = 1, 2, 3, 4
SHT_SYMTAB = 2


class CubinFormatError(ValueError):
    """The bytes are not a CUDA cubin, or one cut short."""


def _sections(image: bytes) -> list[tuple[str, int, int, int, int]]:
    """(name, type, offset, size, link) of every section."""
    if image[:4] != b"\x7fELF" or len(image) < 64 or image[4] != 2 or image[5] != 1:
        raise CubinFormatError("not a 64-bit little-endian ELF file (a cubin)")
    machine, = struct.unpack_from("<H", image, 0x12)
    if machine != EM_CUDA:
        raise CubinFormatError(f"an ELF file for machine {machine}, not a CUDA cubin (machine {EM_CUDA})")
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    if shoff + shnum * shentsize > len(image):
        raise CubinFormatError(f"section headers past the end of the file at {len(image)} bytes (cut short?)")
    headers = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    name_base = headers[shstrndx][4]
    out = []
    for h in headers:
        if h[1] != 8 and h[4] + h[5] > len(image):         # 8: SHT_NOBITS, no bytes in the file
            raise CubinFormatError(f"section past the end of the file at {len(image)} bytes (cut short?)")
        out.append((_string(image, name_base + h[0]), h[1], h[4], h[5], h[6]))
    return out


def _string(image: bytes, offset: int) -> str:
    return image[offset:image.index(b"\0", offset)].decode()


def _symbol_names(image: bytes, sections) -> dict[int, str]:
    """Symbol index -> name, from the symbol table and its string table."""
    for _, kind, offset, size, link in sections:
        if kind == SHT_SYMTAB:
            strings = sections[link][2]
            return {i: _string(image, strings + struct.unpack_from("<I", image, offset + i * 24)[0])
                    for i in range(size // 24)}
    return {}


def attributes(image: bytes, offset: int, size: int):
    """``(attribute, payload bytes)`` of every record in the .nv.info section at ``offset``."""
    pos, end = offset, offset + size
    while pos + 2 <= end:
        fmt, attr = image[pos], image[pos + 1]
        pos += 2
        if fmt == _SVAL:
            length, = struct.unpack_from("<H", image, pos)
            pos += 2
        elif fmt in (_NVAL, _BVAL, _HVAL):
            length = 2                                  # the value field itself (unused for NVAL)
        else:
            raise CubinFormatError(f"unknown .nv.info record format {fmt} at byte {pos - 2}")
        if pos + length > end:
            raise CubinFormatError("an .nv.info record runs past its section")
        yield attr, image[pos:pos + length]
        pos += length


def kernel_resources(image: bytes) -> dict[str, dict[str, int]]:
    """``{function name: {"registers", "stack_bytes", "cumulative_stack_bytes": n}}``.

    Kernels appear under their mangled names; non-inlined device functions (``$kernel$callee``)
    too, with the keys the cubin has for them. Raises ``CubinFormatError`` on other bytes.
    """
    try:
        sections = _sections(image)
        symbols = _symbol_names(image, sections)
        found: dict[str, dict[str, int]] = {}
        for name, _, offset, size, _ in sections:
            if name != ".nv.info" and not name.startswith(".nv.info."):
                continue
            for attr, payload in attributes(image, offset, size):
                if attr in _KEYS and len(payload) == 8:
                    symbol, value = struct.unpack("<II", payload)
                    entry = found.setdefault(symbols.get(symbol, f"symbol {symbol}"), {})
                    key = _KEYS[attr]
                    entry[key] = max(value, entry.get(key, 0))
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, CubinFormatError):
            raise
        raise CubinFormatError(f"malformed cubin ({type(e).__name__}: {e})") from None
    for entry in found.values():
        if "stack_bytes" in entry:
            entry["cumulative_stack_bytes"] = max(entry["stack_bytes"], entry.get("cumulative_stack_bytes", 0))
    return found
