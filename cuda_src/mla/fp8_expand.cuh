// The dense FP8 cache's third warpgroup: expands pages that TMA staged, e4m3, inside the page
// buffers into the fp16 tiles the seesaw's WGMMAs read.
//
// A page buffer holds nine 8 KB tiles (64 rows x 64 fp16 values, 128-byte swizzle). The staged
// page is five 8 KB boxes of 64 rows x 128 e4m3 bytes, unswizzled (a row of any piece of a page
// starts on a 128-byte boundary, as TMA needs): box d < 4 holds tiles 2d and 2d + 1 (bytes 0-63
// and 64-127 of each row) in tile d's space; box 4 holds the RoPE tile (bytes 0-63; the rest is
// TMA's zero fill past the row) in tile 8's space. The seesaw frees those spaces before V_R
// (tiles 4-7): tiles 0-3 once V_L is consumed, tile 8 once QK^T is done, which is where the
// consumers stage the page after next (load_page_tiles<0, 4>).
//
// Order: tile 8 (its own box) as soon as the bytes are in; then, once warpgroup 1 released V_R
// (bar_free; a request's first two pages are staged only after every consumer left the previous
// request), tiles 7..4, whose space holds no box; tiles 3, 2 into boxes 3, 2 once every thread
// has read those; tiles 1, 0 into boxes 1, 0 likewise. The consumers' QK^T takes the tiles in
// this order (SplitKVTraits::kQkFromLastTile).
#pragma once
#include <cuda/std/cstdint>

#include "common/numeric.cuh"
#include "common/sync.cuh"
#include "mla/config.cuh"
#include "mla/splitkv_traits.cuh"

namespace flashmla {

constexpr uint32_t kFp8TileBytes = 64 * kTileCols * 2;                  // an expanded (fp16) tile
constexpr uint32_t kStagedBoxBytes = 64 * kFp8StagedRowBytes;           // one tile's space
constexpr int kStagedBoxes = (kTilesK + 1) / 2;
constexpr uint32_t kStagedPageBytes = kStagedBoxes * kStagedBoxBytes;
static_assert(kFp8StagedRowBytes == 2 * kTileCols && kStagedBoxBytes == kFp8TileBytes, "a box of two tiles' bytes");

// Byte offset of staged box `box` in a page buffer (see above).
__device__ __forceinline__ constexpr uint32_t staged_box_offset(int box) {
    return box < kStagedBoxes - 1 ? box * kStagedBoxBytes : kTilesV * kFp8TileBytes;
}

// 16 e4m3 values, values 16 part .. 16 part + 15 of row `row`, as fp16 into the tile at `tile`
// (64 rows x 64 fp16 values, 128-byte swizzle): two 16-byte chunks of the swizzled row.
__device__ __forceinline__ void store_e4m3_chunk_as_fp16(uint32_t tile, int row, int part, uint4 raw) {
    const uint32_t dst = tile + row * 128;
    store_shared(dst + (((2 * part) ^ (row % 8)) * 16),
                 make_uint4(e4m3x2_to_fp16x2(raw.x & 0xffffu), e4m3x2_to_fp16x2(raw.x >> 16),
                            e4m3x2_to_fp16x2(raw.y & 0xffffu), e4m3x2_to_fp16x2(raw.y >> 16)));
    store_shared(dst + (((2 * part + 1) ^ (row % 8)) * 16),
                 make_uint4(e4m3x2_to_fp16x2(raw.z & 0xffffu), e4m3x2_to_fp16x2(raw.z >> 16),
                            e4m3x2_to_fp16x2(raw.w & 0xffffu), e4m3x2_to_fp16x2(raw.w >> 16)));
}

// An e4m3 q (dense FP8 cache, q_scale): TMA stages Q's 9 tiles as 64 rows x 64 bytes,
// unswizzled, in the upper half of Q's space (kQStagedOffset + 4 KB t); the consumers expand
// them in place into Q's fp16 tiles (8 KB t). Tile t's values cover the staged bytes of tiles
// 2t - 9 and 2t - 8 only, so tiles 0-3 (over no staged bytes) are written at once and tiles
// 4-8 after every consumer has read all its bytes. `tid`: the consumer thread (0-255), which
// converts the 16-byte chunk `tid` of every tile.
constexpr uint32_t kQStagedTileBytes = 64 * kTileCols;
constexpr uint32_t kQStagedOffset = kTilesK * (kFp8TileBytes - kQStagedTileBytes);

template <typename T>
__device__ __forceinline__ void expand_staged_q(typename T::SharedStorage& st, int tid) {
    static_assert(T::kConsumerThreads * 16 == kQStagedTileBytes, "a chunk of each tile per consumer thread");
    const uint32_t q = smem_u32(st.q), staged = q + kQStagedOffset + tid * 16;
    const int row = tid / 4, part = tid % 4;
    constexpr int kEarly = 4;
    uint4 raw[kTilesK - kEarly];
    CUTE_UNROLL
    for (int t = 0; t < kEarly; ++t) raw[t] = load_shared(staged + t * kQStagedTileBytes);
    CUTE_UNROLL
    for (int t = 0; t < kEarly; ++t) store_e4m3_chunk_as_fp16(q + t * kFp8TileBytes, row, part, raw[t]);
    CUTE_UNROLL
    for (int t = kEarly; t < kTilesK; ++t) raw[t - kEarly] = load_shared(staged + t * kQStagedTileBytes);
    consumer_sync<T>();
    CUTE_UNROLL
    for (int t = kEarly; t < kTilesK; ++t) store_e4m3_chunk_as_fp16(q + t * kFp8TileBytes, row, part, raw[t - kEarly]);
    fence_smem_for_async_proxy();                   // the WGMMAs read Q
    consumer_sync<T>();
}

template <typename T>
struct Fp8Expander {
    static constexpr int kExpandBarrier = 9;        // the expander's own named barrier (WgBarrier: 1-8)

    typename T::SharedStorage& st;
    const int idx;                                  // thread within the warpgroup
    uint32_t phases = 0;                            // bit b / 2 + b: buffer b's next bar_staged / bar_free phase

    __device__ __forceinline__ explicit Fp8Expander(typename T::SharedStorage& storage)
        : st(storage), idx(thread_index_here() % 128) {}

    // A tile is 256 chunks of 16 values; this thread's are idx and idx + 128: row c / 4, values
    // 16 (c % 4) .. of the tile.
    __device__ __forceinline__ void read(int buf, int tile, uint4 (&raw)[2]) const {
        const uint32_t staged = smem_u32(st.kv[buf]) + staged_box_offset(tile / 2) + (tile % 2) * kTileCols;
        CUTE_UNROLL
        for (int k = 0; k < 2; ++k) {
            const int c = idx + 128 * k;
            raw[k] = load_shared(staged + (c / 4) * kFp8StagedRowBytes + (c % 4) * 16);
        }
    }

    // Each chunk becomes fp16 in the tile; then the tile's barrier.
    __device__ __forceinline__ void write(int buf, int tile, const uint4 (&raw)[2]) const {
        const uint32_t dst = smem_u32(st.kv[buf]) + tile * kFp8TileBytes;
        CUTE_UNROLL
        for (int k = 0; k < 2; ++k) {
            const int c = idx + 128 * k;
            store_e4m3_chunk_as_fp16(dst, c / 4, c % 4, raw[k]);
        }
        fence_smem_for_async_proxy();               // the consumers' WGMMAs read these stores
        __syncwarp();
        if (idx % 32 == 0) mbarrier_arrive(smem_u32(&st.bar_kv[buf][tile]));
    }

    __device__ __forceinline__ void everyone_has_read() const { named_barrier_sync(kExpandBarrier, 128); }

    // The page in buffer `buf`, the `nth` page of its request (0, 1, ...).
    __device__ __forceinline__ void expand_page(int buf, int nth) {
        const uint32_t bar_staged = smem_u32(&st.bar_staged[buf]);
        if (idx == 0) mbarrier_arrive_expect_tx(bar_staged, kStagedPageBytes);
        mbarrier_wait(bar_staged, (phases >> buf) & 1);
        phases ^= 1u << buf;
        uint4 raw[2];
        read(buf, kTilesK - 1, raw);
        everyone_has_read();
        write(buf, kTilesK - 1, raw);
        read(buf, kTilesV - 1, raw);                            // staged: read before V_R is free
        if (nth >= 2) {
            mbarrier_wait(smem_u32(&st.bar_free[buf]), (phases >> (2 + buf)) & 1);
            phases ^= 4u << buf;
        }
        CUTE_UNROLL
        for (int tile = kTilesV - 1; tile >= 0; --tile) {
            if (tile == 3 || tile == 1) everyone_has_read();    // boxes 3, 2 / 1 are free
            if (tile < kTilesV - 1) read(buf, tile, raw);
            if (tile == 0) everyone_has_read();                 // box 0 holds tile 0 too
            write(buf, tile, raw);
        }
    }
};

}  // namespace flashmla
