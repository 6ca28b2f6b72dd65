// The dense FP8 cache's third warpgroup: expands pages that TMA staged, e4m3, inside the page
// buffers into the fp16 tiles the seesaw's WGMMAs read.
//
// A page buffer holds nine 8 KB tiles (64 rows x 64 fp16 values, 128-byte swizzle). The raw page
// is nine 4 KB boxes (64 rows x 64 e4m3 bytes, unswizzled): box t < 8 (NoPE) at 4t KB, in the
// space of tiles 0-3, and box 8 (RoPE) at 64 KB, in tile 8's. The seesaw frees those before V_R
// (tiles 4-7): tiles 0-3 once V_L is consumed, tile 8 once QK^T is done, which is where the
// consumers issue the raw loads of the page after next (load_page_tiles<0, 4>). Expanding tile
// t writes [8t, 8t + 8) KB, which holds raw boxes 2t and 2t + 1 for t < 4, nothing for 4 <= t < 8,
// and box 8 for t = 8. So the order 8, 7, ..., 0 never overwrites a box still to be read, as long
// as every thread has read its part of a box before any writes its tile (a barrier per tile).
// Tile 8 may be expanded as soon as the bytes are in; tiles 7..0 wait until warpgroup 1 has
// released V_R (bar_free), except on a request's first two pages, which are loaded only after
// every consumer left the previous request.
#pragma once
#include <cuda/std/cstdint>

#include "common/sync.cuh"
#include "mla/config.cuh"
#include "mla/fp8_producer.cuh"
#include "mla/splitkv_traits.cuh"

namespace flashmla {

constexpr uint32_t kRawBoxBytes = 64 * kTileCols;                   // 64 rows x 64 e4m3 values
constexpr uint32_t kRawPageBytes = kTilesK * kRawBoxBytes;

// Byte offset of raw box `t` in a page buffer (see above).
__device__ __forceinline__ constexpr uint32_t raw_box_offset(int t) {
    return t < kTilesV ? t * kRawBoxBytes : kTilesV * 64 * kTileCols * 2;
}

template <typename T>
struct Fp8Expander {
    static constexpr uint32_t kTileBytes = 64 * kTileCols * 2;
    static constexpr int kExpandBarrier = 9;        // the expander's own named barrier (WgBarrier: 1-8)

    typename T::SharedStorage& st;
    const int idx;                                  // thread within the warpgroup
    uint32_t raw_phase = 0, free_phase = 0;         // bit b: page buffer b's next phase

    __device__ __forceinline__ explicit Fp8Expander(typename T::SharedStorage& storage)
        : st(storage), idx(threadIdx.x % 128) {}

    // Raw box t of buffer `buf` into tile t: 256 chunks of 16 values, chunks idx and idx + 128
    // (row c / 4, values 16 (c % 4) ..), each two 16-byte fp16 chunks of the swizzled row.
    __device__ __forceinline__ void expand_tile(int buf, int t) const {
        const uint32_t page = smem_u32(st.kv[buf]);
        uint4 raw[2];
        CUTE_UNROLL
        for (int k = 0; k < 2; ++k) raw[k] = load_shared(page + raw_box_offset(t) + 16 * (idx + 128 * k));
        named_barrier_sync(kExpandBarrier, 128);
        CUTE_UNROLL
        for (int k = 0; k < 2; ++k) {
            const int c = idx + 128 * k, row = c / 4, part = c % 4;
            const uint32_t w[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
            const uint32_t dst = page + t * kTileBytes + row * 128;
            store_shared(dst + (((2 * part) ^ (row % 8)) * 16),
                         make_uint4(e4m3x2_to_fp16x2(w[0] & 0xffffu), e4m3x2_to_fp16x2(w[0] >> 16),
                                    e4m3x2_to_fp16x2(w[1] & 0xffffu), e4m3x2_to_fp16x2(w[1] >> 16)));
            store_shared(dst + (((2 * part + 1) ^ (row % 8)) * 16),
                         make_uint4(e4m3x2_to_fp16x2(w[2] & 0xffffu), e4m3x2_to_fp16x2(w[2] >> 16),
                                    e4m3x2_to_fp16x2(w[3] & 0xffffu), e4m3x2_to_fp16x2(w[3] >> 16)));
        }
        fence_smem_for_async_proxy();               // the consumers' WGMMAs read these stores
        __syncwarp();
        if (idx % 32 == 0) mbarrier_arrive(smem_u32(&st.bar_kv[buf][t]));
    }

    // The page in buffer `buf`, the `nth` page of its request (0, 1, ...).
    __device__ __forceinline__ void expand_page(int buf, int nth) {
        const uint32_t bar_raw = smem_u32(&st.bar_raw[buf]);
        if (idx == 0) mbarrier_arrive_expect_tx(bar_raw, kRawPageBytes);
        mbarrier_wait(bar_raw, (raw_phase >> buf) & 1);
        raw_phase ^= 1u << buf;
        expand_tile(buf, kTilesK - 1);
        if (nth >= 2) {
            mbarrier_wait(smem_u32(&st.bar_free[buf]), (free_phase >> buf) & 1);
            free_phase ^= 1u << buf;
        }
        #pragma unroll 1
        for (int t = kTilesV - 1; t >= 0; --t) expand_tile(buf, t);
    }
};

}  // namespace flashmla
