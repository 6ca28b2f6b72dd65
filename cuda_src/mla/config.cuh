// Problem constants of MLA decoding (DeepSeek V2/V3 latent attention) and the arch guard.
//
// The values come from flashmla_cupy/constants.py (the one source), as -DFLASHMLA_<NAME>.
#pragma once
#include "common/numeric.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "flashmla-cupy's MLA kernels use WGMMA and TMA: compile with -arch=sm_90a"
#endif
#if !defined(FLASHMLA_HEAD_DIM_K) || !defined(FLASHMLA_SCHED_META_INTS) || !defined(FLASHMLA_ERROR_SCHEDULE)
#error "compile through flashmla_cupy (it defines the constants shared with Python)"
#endif

namespace flashmla {

constexpr int kHeadDimK = FLASHMLA_HEAD_DIM_K;     // latent (512) + rope (64): K row and Q row
constexpr int kHeadDimV = FLASHMLA_HEAD_DIM_V;     // V is the first 512 columns of the same cache row
// Tokens per step of the split-KV kernels: what they call a page (one page buffer, one
// scheduler unit). The cache's own pages (page_block_size) may be smaller or larger.
constexpr int kBlockN = FLASHMLA_BLOCK_N;
constexpr int kBlockM = FLASHMLA_BLOCK_M;          // query rows (heads x MTP tokens) per CTA
constexpr int kTileCols = FLASHMLA_TMA_BOX;        // one TMA box / swizzle atom: 64 columns = 128 bytes
constexpr int kTilesK = kHeadDimK / kTileCols;     // 9 tiles per K (or Q) row block
constexpr uint32_t kFp16TileBytes = 64 * kTileCols * 2;   // a tile of fp16 values (the FP8 kernels' page buffers)
constexpr int kTilesV = kHeadDimV / kTileCols;     // 8 tiles per V row block
constexpr int kSplitKVThreads = FLASHMLA_SPLITKV_THREADS;
constexpr int kProducerThreads = FLASHMLA_PRODUCER_THREADS;
constexpr int kFp8StagedRowBytes = FLASHMLA_FP8_STAGED_ROW_BYTES;   // dense FP8 cache: fp8_expand.cuh
constexpr int kFp8NarrowRows = FLASHMLA_FP8_NARROW_ROWS;            // dense FP8 cache: fp8_narrow_kernel.cu
constexpr int kFp8NarrowMmaSyncRows = FLASHMLA_FP8_NARROW_MMA_SYNC_ROWS;
constexpr int kFp8NarrowStages = FLASHMLA_FP8_NARROW_STAGES;
constexpr int kFp8NarrowThreads = FLASHMLA_FP8_NARROW_THREADS;
constexpr int kCombineWarps = FLASHMLA_COMBINE_WARPS;
constexpr int kOutStoreBytes = FLASHMLA_OUT_STORE_BYTES;            // splitkv_epilogue.cuh's stores of the output
static_assert(kBlockN == FLASHMLA_TMA_BOX && kBlockM == FLASHMLA_TMA_BOX, "a page buffer tile is 64 rows x 64 columns");

// Tile scheduler: a request costs its number of pages plus this constant (its setup and
// epilogue); each SM part gets about the same total cost.
constexpr int kFixedOverheadBlocks = FLASHMLA_FIXED_OVERHEAD_BLOCKS;
// Per SM part: [begin_req, begin_token, end_req, end_token, begin_split, topk (-1: dense), 0, 0]
constexpr int kSchedMetaInts = FLASHMLA_SCHED_META_INTS;

// DeepSeek-V3.2's FP8 cache token: 512 float8_e4m3 NoPE values, a float32 scale per 128 of
// them, 64 bf16 RoPE values.
constexpr int kFp8QuantTile = FLASHMLA_FP8_QUANT_TILE;
constexpr int kFp8NumScales = FLASHMLA_FP8_NUM_SCALES;
constexpr int kHeadDimRope = FLASHMLA_HEAD_DIM_ROPE;
constexpr int kFp8TokenBytes = FLASHMLA_FP8_TOKEN_BYTES;
static_assert(kFp8TokenBytes == kHeadDimV + 4 * kFp8NumScales + 2 * kHeadDimRope, "FP8 token layout");
constexpr int kFp8RopeOffset = kHeadDimV + 4 * kFp8NumScales;   // bytes: NoPE values, then scales, then RoPE

}  // namespace flashmla
