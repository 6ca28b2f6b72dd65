// Problem constants of MLA decoding (DeepSeek V2/V3 latent attention) and the arch guard.
#pragma once
#include "common/numeric.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "flashmla-cupy's MLA kernels use WGMMA and TMA: compile with -arch=sm_90a"
#endif

namespace flashmla {

constexpr int kHeadDimK = 576;       // latent (512) + rope (64): K row and Q row
constexpr int kHeadDimV = 512;       // V is the first 512 columns of the same cache row
constexpr int kPageBlock = 64;       // tokens per KV-cache page
constexpr int kBlockM = 64;          // query rows (heads x MTP tokens) per CTA
constexpr int kTileCols = 64;        // one TMA box / swizzle atom: 64 columns = 128 bytes
constexpr int kTilesK = kHeadDimK / kTileCols;   // 9 tiles per K (or Q) row block
constexpr int kTilesV = kHeadDimV / kTileCols;   // 8 tiles per V row block

// Tile scheduler: a request costs its number of pages plus this constant (its setup and
// epilogue); each SM part gets about the same total cost.
constexpr int kFixedOverheadBlocks = 5;
constexpr int kSchedMetaInts = 8;    // [begin_req, begin_token, end_req, end_token, begin_split, -, -, -]

}  // namespace flashmla
