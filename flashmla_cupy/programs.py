"""The registry of NVRTC programs: every kernel the package compiles, in one place.

The MLA host path (``plan``, ``mla``), ``flashmla-cupy compile`` and the profiler all take their
programs from here. Each program gets the shared constants (``constants.defines``) and the
host-side struct sizes (``params.layout_defines``), which the device code checks.
"""
from __future__ import annotations

from . import constants
from .compiler import Program
from .params import layout_defines

DTYPE_TAGS = ("bf16", "fp16")
SPARSE_FP8_TAG = "fp8_sparse"      # DeepSeek-V3.2's sparse decoding over its 656-byte FP8 cache
FP8_TAG = "fp8"                    # the dense e4m3 cache with one scale per tensor, bf16 q
FP8_Q_TAG = "fp8q"                 # the same cache with an e4m3 q (QK^T in FP8 WGMMA)
# Split-KV programs with a form for one-token pages (tokens copied with cp.async): all but the sparse one.
ONE_TOKEN_PAGE_TAGS = (*DTYPE_TAGS, FP8_TAG, FP8_Q_TAG)
_CTYPES = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t"}


def _splitkv_smem_bytes() -> int:
    """The split-KV kernel's SharedStorage (splitkv_traits.cuh; the compile checks they agree):
    Q and two pages of 64 x 576 16-bit values, P0 (64 x 64), six 64-float row vectors, two
    bad-request flags, two split indices, two 64-bit token masks, 31 mbarriers, padded to 1024
    bytes."""
    tile = constants.BLOCK_M * constants.TMA_BOX * 2
    tiles_k = constants.HEAD_DIM_K // constants.TMA_BOX
    size = (3 * tiles_k * tile + tile + 6 * constants.BLOCK_M * 4 + 2 * 4 + 2 * 4 + 2 * 8
            + (2 * tiles_k + 4 + 2 + 1 + 4 + 2) * 8)
    return -(-size // 1024) * 1024


SPLITKV_SMEM_BYTES = _splitkv_smem_bytes()


def _fp8_narrow_smem_bytes() -> int:
    """The narrow kernel's NarrowStorage (fp8_narrow_kernel.cu; the compile checks they agree): the
    ring of staged pages (five boxes of 64 rows x 128 bytes each), Q's nine 64 x 64 16-bit tiles,
    per group of consumer warps (two) two P buffers (FP8_NARROW_ROWS x 64 fp16) and per-warp row
    maxima (two pages) and sums, the merge's row maxima, sums and flag, a flag per stage, per stage
    an mbarrier per group ("full") and one ("empty"), Q's, padded to 1024 bytes."""
    page = 5 * constants.BLOCK_N * constants.FP8_STAGED_ROW_BYTES
    q = (constants.HEAD_DIM_K // constants.TMA_BOX) * constants.BLOCK_M * constants.TMA_BOX * 2
    groups = constants.FP8_NARROW_THREADS // 128 - 1   # and a loading warpgroup
    p = groups * 2 * constants.FP8_NARROW_ROWS * constants.BLOCK_N * 2
    rows = (groups * (2 * 4 + 4) + groups + 1) * constants.FP8_NARROW_ROWS * 4 + 4
    size = constants.FP8_NARROW_STAGES * (page + 4) + q + p + rows
    size = -(-size // 8) * 8 + 8 * ((groups + 1) * constants.FP8_NARROW_STAGES + 1)
    return -(-size // 1024) * 1024


FP8_NARROW_SMEM_BYTES = _fp8_narrow_smem_bytes()


def _mla_defines() -> tuple[tuple[str, str], ...]:
    return constants.defines() + layout_defines()


def sparse_pairs(h_q: int) -> bool:
    """Whether sparse decoding runs h_q query heads in pairs of CTAs (clusters of two that share
    each dequantized page): where h_q makes an even number of 64-row m-blocks."""
    return -(-h_q // constants.BLOCK_M) % 2 == 0


def splitkv_program(tag: str, one_token_pages: bool = False, alone: bool = False) -> Program:
    """The split-KV kernel for a q/cache dtype tag (``DTYPE_TAGS``), ``SPARSE_FP8_TAG``, ``FP8_TAG``
    (the FP8 caches: bf16 q, fp16 inside) or ``FP8_Q_TAG`` (the dense FP8 cache, e4m3 q).
    ``one_token_pages`` (``ONE_TOKEN_PAGE_TAGS``): the form for a page_block_size of 1, which
    copies the tokens with cp.async; a program of its own, compiled where that page size is used.
    Sparse: by default the form for pairs of CTAs that share each page (two m-blocks, h_q 128);
    ``alone``, the form for a CTA that dequantizes its pages alone (one m-block), a program of
    its own too."""
    fp8 = {SPARSE_FP8_TAG: "kFp8Sparse, false", FP8_TAG: "kFp8, false", FP8_Q_TAG: "kFp8, true"}
    if one_token_pages and tag not in ONE_TOKEN_PAGE_TAGS:
        raise ValueError(f"one-token pages have a program of their own for {', '.join(ONE_TOKEN_PAGE_TAGS)}, not {tag}")
    if alone and tag != SPARSE_FP8_TAG:
        raise ValueError(f"the form for CTAs alone is {SPARSE_FP8_TAG}'s, not {tag}'s")
    args = (f"cutlass::half_t, flashmla::KVCache::{fp8[tag]}" if tag in fp8
            else f"{_CTYPES[tag]}, flashmla::KVCache::k16Bit, false")
    form = ", true" if one_token_pages else ", false, false" if alone else ", false, true" if tag == SPARSE_FP8_TAG else ""
    kernel = f"flashmla::splitkv_mla_kernel<{args}{form}>"
    name = f"{tag}{', page 1' if one_token_pages else ''}{', alone' if alone else ''}"
    return Program(f"splitkv_mla<{name}>", "mla/splitkv_kernel.cu",
                   (kernel,), _mla_defines() + (("FLASHMLA_SPLITKV_SMEM_BYTES", str(SPLITKV_SMEM_BYTES)),))


_NARROW_FORMS = tuple((rows, one_token_pages) for one_token_pages in (False, True)
                      for rows in (constants.FP8_NARROW_MMA_SYNC_ROWS, constants.FP8_NARROW_ROWS))


def fp8_narrow_program() -> Program:
    """The dense FP8 cache with a bf16 q and at most ``FP8_NARROW_ROWS`` query rows per KV head: its
    forms for up to ``FP8_NARROW_MMA_SYNC_ROWS`` rows and for more (``fp8_narrow_kernel``), each
    also for one-token pages (copied by the loading warpgroup's four warps with cp.async)."""
    return Program("fp8_narrow_mla", "mla/fp8_narrow_kernel.cu",
                   tuple(f"flashmla::fp8_narrow_mla_kernel<{rows}, {str(tokens).lower()}>"
                         for rows, tokens in _NARROW_FORMS),
                   _mla_defines() + (("FLASHMLA_FP8_NARROW_SMEM_BYTES", str(FP8_NARROW_SMEM_BYTES)),))


def fp8_narrow_form(q_rows: int, one_token_pages: bool = False) -> tuple[str, int]:
    """The narrow kernel's form for ``q_rows`` query rows per KV head (at most ``FP8_NARROW_ROWS``)
    and the cache's pages: its name expression and threads per CTA."""
    mma_sync = q_rows <= constants.FP8_NARROW_MMA_SYNC_ROWS
    rows = constants.FP8_NARROW_MMA_SYNC_ROWS if mma_sync else constants.FP8_NARROW_ROWS
    return fp8_narrow_program().kernels[_NARROW_FORMS.index((rows, one_token_pages))], constants.FP8_NARROW_THREADS


def combine_program(tag: str) -> Program:
    return Program(f"mla_combine<{tag}>", "mla/combine_kernel.cu",
                   (f"flashmla::mla_combine_kernel<{_CTYPES[tag]}>",), _mla_defines())


def metadata_program() -> Program:
    return Program("mla_metadata", "mla/metadata_kernel.cu", ("flashmla::mla_metadata_kernel",),
                   _mla_defines())


def mla_programs() -> list[Program]:
    return [*(splitkv_program(t) for t in (*DTYPE_TAGS, SPARSE_FP8_TAG, FP8_TAG, FP8_Q_TAG)),
            splitkv_program(SPARSE_FP8_TAG, alone=True),
            *(splitkv_program(t, one_token_pages=True) for t in ONE_TOKEN_PAGE_TAGS),
            fp8_narrow_program(), *(combine_program(t) for t in DTYPE_TAGS), metadata_program()]


def all_programs() -> list[Program]:
    """Every program of the package (``flashmla-cupy compile`` builds these)."""
    from . import attention
    return mla_programs() + attention.all_programs()
