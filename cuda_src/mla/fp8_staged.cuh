// Where TMA stages a dense FP8 page's e4m3 bytes inside its page buffer, and an e4m3 Q's inside
// Q's buffer: boxes of 64 rows x 128 bytes with TMA's 128-byte swizzle.
//
// A page buffer holds nine 8 KB tiles (64 rows x 64 fp16 values, 128-byte swizzle). The staged
// page is five 8 KB boxes: box d < 4 holds the values of tiles 2d and 2d + 1 (bytes 0-63 and
// 64-127 of each row) in tile d's space; box 4 holds the RoPE part (bytes 0-63; the rest is
// TMA's zero fill past the 576-byte row) in tile 8's space. Rows of 128 bytes put every row of
// any piece of a page on the 128-byte boundary TMA needs, and the swizzle (a function of the
// shared address, so pieces of a few rows keep it) makes each box a K-major operand of FP8
// WGMMA as it stands and spreads the expander's reads over all banks. An e4m3 Q is staged the
// same way, box b at 8 KB b of Q's buffer.
//
// With an e4m3 q the boxes are never overwritten: the expander writes V^T (e4m3, 512 rows of the
// page's 64 tokens, 64-byte swizzle) into tiles 4-7's space, between them.
#pragma once
#include <cuda/std/cstdint>

#include "common/tma.cuh"
#include "mla/config.cuh"

namespace flashmla {

constexpr uint32_t kStagedBoxBytes = 64 * kFp8StagedRowBytes;           // one tile's space
constexpr int kStagedBoxes = (kTilesK + 1) / 2;
constexpr uint32_t kStagedPageBytes = kStagedBoxes * kStagedBoxBytes;
static_assert(kFp8StagedRowBytes == kSwizzleRowBytes && kStagedBoxBytes == kFp16TileBytes, "a box of two tiles' bytes");

// Byte offset of staged box `box` in a page buffer (see above).
__device__ __forceinline__ constexpr uint32_t staged_box_offset(int box) {
    return box < kStagedBoxes - 1 ? box * kStagedBoxBytes : kTilesV * kFp16TileBytes;
}

// An e4m3 q: where V^T's half `half` (columns 256 half .. 256 half + 255) lies in a page buffer.
constexpr uint32_t kTransposedVHalfBytes = kHeadDimV / 2 * kBlockN;
__device__ __forceinline__ constexpr uint32_t transposed_v_offset(int half) {
    return (kStagedBoxes - 1) * kStagedBoxBytes + half * kTransposedVHalfBytes;
}
static_assert(transposed_v_offset(2) == staged_box_offset(kStagedBoxes - 1), "V^T fills tiles 4-7's space");

// Byte `byte` (< 64) of row `row` of a K-major e4m3 operand with 64-byte rows and the 64-byte
// swizzle (GMMA::Layout_K_SW64_Atom): a row's 16-byte chunks permuted by bits 1-2 of the row.
__device__ __forceinline__ constexpr uint32_t sw64_offset(int row, int byte) {
    return row * 64 + (((byte >> 4) ^ (row >> 1)) & 3) * 16 + (byte & 15);
}

}  // namespace flashmla
