"""Constants that Python and the device code share: defined here only, passed to NVRTC as ``-D``.

``cuda_src/mla/config.cuh`` turns each ``FLASHMLA_<NAME>`` define into its ``constexpr`` (and
refuses to compile without them), so the host's sizes, grids and checks cannot drift from the
kernels'. The scheduler constants are also the Python model's (``scheduler.py``).
"""
from __future__ import annotations

HEAD_DIM_K = 576            # latent (512) + RoPE (64): a K row and a Q row
HEAD_DIM_V = 512            # V is the first 512 columns of the same cache row
BLOCK_N = 64                # tokens per split-KV step (the scheduler's unit); cache pages may be larger or smaller
BLOCK_M = 64                # query rows (heads x MTP tokens) per split-KV CTA
TMA_BOX = 64                # a TMA box is 64 rows x 64 columns (128 bytes of 16-bit values: one swizzle atom)
SPLITKV_THREADS = 256       # two warpgroups
PRODUCER_THREADS = 128      # the third warpgroup: fills the FP8 caches' page buffers with fp16 values; the 16-bit cache's loads
# The dense FP8 cache is staged by TMA in boxes of 128 e4m3 bytes per row (two tiles' columns):
# every row of any piece of a page then starts on the 128-byte boundary TMA needs.
FP8_STAGED_ROW_BYTES = 128
# The dense FP8 cache with a bf16 q and at most this many query rows per KV head (h_q * s_q / h_kv)
# runs the narrow kernel (fp8_narrow_kernel.cu): two warpgroups that take the pages in turn and
# dequantize in registers, and a loading warp (of a third), over a ring of this many staged pages.
# Its form for at most FP8_NARROW_MMA_SYNC_ROWS rows (one m16 tile) uses mma.sync, the one for
# more WGMMA (N = 32).
FP8_NARROW_ROWS = 32
FP8_NARROW_MMA_SYNC_ROWS = 16
FP8_NARROW_STAGES = 3
FP8_NARROW_THREADS = 384
COMBINE_WARPS = 8           # one query row per warp
OUT_STORE_BYTES = 16        # the split-KV kernels store the output 16 bytes at a time: out starts on such a boundary
FIXED_OVERHEAD_BLOCKS = 5   # scheduler: cost of one request piece beyond its pages, in pages
SCHED_META_INTS = 8         # ints per SM part in tile_scheduler_metadata

# DeepSeek-V3.2's FP8 KV cache (sparse decoding): per token 512 float8_e4m3 NoPE values, one
# float32 scale per 128 of them, then the 64 RoPE values in bf16 (656 bytes).
FP8_QUANT_TILE = 128        # NoPE values per scale
FP8_NUM_SCALES = HEAD_DIM_V // FP8_QUANT_TILE
HEAD_DIM_ROPE = HEAD_DIM_K - HEAD_DIM_V
FP8_TOKEN_BYTES = HEAD_DIM_V + 4 * FP8_NUM_SCALES + 2 * HEAD_DIM_ROPE

# Codes of the errors that the kernels record (errors.py turns them into messages).
ERROR_SEQLEN_NEGATIVE = 1   # cache_seqlens[i] < 0 (metadata kernel)
ERROR_SEQLEN_RANGE = 2      # cache_seqlens[i] outside [0, page_block_size * block_table columns] (split-KV kernel)
ERROR_BLOCK_ID = 3          # a block id the call reads is outside [0, num_blocks) (split-KV kernel)
ERROR_SCHEDULE = 4          # metadata / num_splits inconsistent with this batch (split-KV, combine)
ERROR_METADATA_KIND = 5     # metadata of another kind of call: other topk, dense vs sparse (split-KV kernel)

_SHARED = ("HEAD_DIM_K", "HEAD_DIM_V", "BLOCK_N", "BLOCK_M", "TMA_BOX", "SPLITKV_THREADS",
           "PRODUCER_THREADS", "FP8_STAGED_ROW_BYTES", "FP8_NARROW_ROWS", "FP8_NARROW_MMA_SYNC_ROWS",
           "FP8_NARROW_STAGES", "FP8_NARROW_THREADS",
           "COMBINE_WARPS", "OUT_STORE_BYTES", "FIXED_OVERHEAD_BLOCKS", "SCHED_META_INTS", "FP8_QUANT_TILE",
           "FP8_NUM_SCALES", "HEAD_DIM_ROPE", "FP8_TOKEN_BYTES", "ERROR_SEQLEN_NEGATIVE",
           "ERROR_SEQLEN_RANGE", "ERROR_BLOCK_ID", "ERROR_SCHEDULE", "ERROR_METADATA_KIND")


def defines() -> tuple[tuple[str, str], ...]:
    """``(FLASHMLA_<NAME>, value)`` for every shared constant (NVRTC ``-D`` options)."""
    return tuple((f"FLASHMLA_{name}", str(globals()[name])) for name in _SHARED)
