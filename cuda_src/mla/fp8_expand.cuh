// The dense FP8 cache's third warpgroup: expands pages that TMA staged, e4m3, inside the page
// buffers (fp8_staged.cuh) into the fp16 tiles the seesaw's WGMMAs read.
//
// The seesaw frees a staged page's boxes before V_R (tiles 4-7): tiles 0-3 once V_L is consumed,
// tile 8 once QK^T is done, which is where the consumers stage the page after next
// (load_page_tiles<0, 4>).
//
// Order, bf16 q: tile 8 (its own box) as soon as the bytes are in; then, once warpgroup 1
// released V_R (bar_free; a request's first two pages are staged only after every consumer left
// the previous request), tiles 7..4, whose space holds no box; tiles 3, 2 into boxes 3, 2 once
// every thread has read those; tiles 1, 0 into boxes 1, 0 likewise. The consumers' QK^T takes
// the tiles in this order (SplitKVTraits::kQkFromLastTile).
// An e4m3 q (T::kE4m3Q): QK^T is an FP8 WGMMA on the staged boxes themselves, so only V's tiles
// 7..0 are expanded, and tiles 3..0, which overwrite boxes, wait until that QK^T is done
// (k_read_barrier).
#pragma once
#include <cuda/std/cstdint>

#include "common/numeric.cuh"
#include "common/sync.cuh"
#include "mla/config.cuh"
#include "mla/fp8_staged.cuh"
#include "mla/splitkv_traits.cuh"

namespace flashmla {

// 16 e4m3 values, values 16 part .. 16 part + 15 of row `row`, as fp16 into the tile at `tile`
// (64 rows x 64 fp16 values, 128-byte swizzle): two 16-byte chunks of the swizzled row.
__device__ __forceinline__ void store_e4m3_chunk_as_fp16(uint32_t tile, int row, int part, uint4 raw) {
    store_shared(swizzled_chunk(tile, row, 2 * part),
                 make_uint4(e4m3x2_to_fp16x2(raw.x & 0xffffu), e4m3x2_to_fp16x2(raw.x >> 16),
                            e4m3x2_to_fp16x2(raw.y & 0xffffu), e4m3x2_to_fp16x2(raw.y >> 16)));
    store_shared(swizzled_chunk(tile, row, 2 * part + 1),
                 make_uint4(e4m3x2_to_fp16x2(raw.z & 0xffffu), e4m3x2_to_fp16x2(raw.z >> 16),
                            e4m3x2_to_fp16x2(raw.w & 0xffffu), e4m3x2_to_fp16x2(raw.w >> 16)));
}

template <typename T>
struct Fp8Expander {
    static constexpr int kExpandBarrier = 9;        // the expander's own named barrier (WgBarrier: 1-8)

    typename T::SharedStorage& st;
    const int idx;                                  // thread within the warpgroup
    // bit b / 2 + b / 4 + b: buffer b's next bar_staged / bar_free / k_read_barrier phase
    uint32_t phases = 0;

    __device__ __forceinline__ explicit Fp8Expander(typename T::SharedStorage& storage)
        : st(storage), idx(thread_index_here() % 128) {}

    // A tile is 256 chunks of 16 values; this thread's are idx and idx + 128: row c / 4, values
    // 16 (c % 4) .. of the tile, the chunk 4 (tile % 2) + c % 4 of its staged row. Rows from
    // `valid` on hold no token of the request: their cache slots may hold anything (NaN), and
    // 0 * NaN would leak into O although their P is 0, so they read as zeros.
    __device__ __forceinline__ void read(int buf, int tile, int valid, uint4 (&raw)[2]) const {
        const uint32_t staged = smem_u32(st.kv[buf]) + staged_box_offset(tile / 2);
        CUTE_UNROLL
        for (int k = 0; k < 2; ++k) {
            const int c = idx + 128 * k;
            raw[k] = c / 4 < valid ? load_shared(swizzled_chunk(staged, c / 4, 4 * (tile % 2) + c % 4))
                                   : make_uint4(0, 0, 0, 0);
        }
    }

    // Each chunk becomes fp16 in the tile; then the tile's barrier.
    __device__ __forceinline__ void write(int buf, int tile, const uint4 (&raw)[2]) const {
        const uint32_t dst = smem_u32(st.kv[buf]) + tile * kFp16TileBytes;
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

    // The page in buffer `buf`, the `nth` page of its request (0, 1, ...), whose first `valid`
    // rows hold tokens.
    __device__ __forceinline__ void expand_page(int buf, int nth, int valid) {
        const uint32_t bar_staged = smem_u32(&st.bar_staged[buf]);
        if (idx == 0) mbarrier_arrive_expect_tx(bar_staged, kStagedPageBytes);
        mbarrier_wait(bar_staged, (phases >> buf) & 1);
        phases ^= 1u << buf;
        // Tiles from the first to expand down to 0, each tile's bytes read while the one before
        // is written (the reads touch no space a write overwrites before the barrier below it).
        constexpr int kFirst = T::kE4m3Q ? kTilesV - 1 : kTilesK - 1;
        uint4 raw[2], next[2];
        read(buf, kFirst, valid, raw);
        CUTE_UNROLL
        for (int tile = kFirst; tile >= 0; --tile) {
            if (tile > 0) read(buf, tile - 1, valid, next);
            if (tile == kTilesV - 1 && nth >= 2) {               // tiles 7..4 go where V_R was
                mbarrier_wait(smem_u32(&st.bar_free[buf]), (phases >> (2 + buf)) & 1);
                phases ^= 4u << buf;
            }
            if constexpr (T::kE4m3Q) {
                if (tile == 3) {                                // QK^T has read the boxes
                    mbarrier_wait(k_read_barrier(st, buf), (phases >> (4 + buf)) & 1);
                    phases ^= 16u << buf;
                }
            }
            // Box 4 (tile 8's own bytes), boxes 3 and 2, boxes 1 and 0 are read by every thread.
            if (tile == kTilesK - 1 || tile == 3 || tile == 1) everyone_has_read();
            write(buf, tile, raw);
            raw[0] = next[0];
            raw[1] = next[1];
        }
    }
};

}  // namespace flashmla
