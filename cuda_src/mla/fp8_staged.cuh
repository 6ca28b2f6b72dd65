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
// page's 64 tokens, 64-byte swizzle) into a ring of three V^T buffers: tiles 4-7's space of each
// page buffer, between the boxes, and Q's buffer past the staged Q (an e4m3 Q takes 5 of its 9
// tiles; warpgroup 1's P, which 16-bit kernels keep in Q's tile 8, goes to p0's second half).
#pragma once
#include <cuda/std/cstdint>

#include "common/sync.cuh"
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

// One-token pages, where TMA would take five boxes a token: one token's chunk `chunk` (16 bytes)
// of each box, from its 576-byte cache row at `row` (chunk * 16 into it) to `box_dst(box)`, with
// cp.async. Box 4's bytes past the row, and every byte of a token outside the cache (`inside`
// false), are zeros and read nothing, as TMA's fill.
template <typename BoxDst>
__device__ __forceinline__ void copy_staged_chunks(const uint8_t* row, bool inside, int chunk, BoxDst box_dst) {
    #pragma unroll
    for (int box = 0; box < kStagedBoxes; ++box) {
        const bool in_row = box < kStagedBoxes - 1 || chunk * 16 < kHeadDimK % kFp8StagedRowBytes;
        cp_async_16(box_dst(box), row + (in_row ? box * kFp8StagedRowBytes : 0), inside && in_row ? 16 : 0);
    }
}

// An e4m3 q: a V^T buffer, half `half` (columns 256 half .. 256 half + 255) at half * its bytes;
// buffer v < 2 in page buffer v, buffer 2 in Q's buffer.
constexpr int kTransposedVBuffers = 3;
constexpr uint32_t kTransposedVHalfBytes = kHeadDimV / 2 * kBlockN;
constexpr uint32_t kTransposedVInPage = (kStagedBoxes - 1) * kStagedBoxBytes;
constexpr uint32_t kTransposedVInQ = kStagedPageBytes;
static_assert(kTransposedVInPage + 2 * kTransposedVHalfBytes == staged_box_offset(kStagedBoxes - 1),
              "V^T fills tiles 4-7's space");
static_assert(kTransposedVInQ + 2 * kTransposedVHalfBytes == kTilesK * kFp16TileBytes, "V^T fills Q's tiles 5-8");
constexpr uint32_t kE4m3PBytes = kBlockM * kBlockN;                    // an e4m3 P

// Byte `byte` (< 64) of row `row` of a K-major e4m3 operand with 64-byte rows and the 64-byte
// swizzle (GMMA::Layout_K_SW64_Atom): a row's 16-byte chunks permuted by bits 1-2 of the row.
__device__ __forceinline__ constexpr uint32_t sw64_offset(int row, int byte) {
    return row * 64 + (((byte >> 4) ^ (row >> 1)) & 3) * 16 + (byte & 15);
}

}  // namespace flashmla
