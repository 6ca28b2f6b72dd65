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
// An e4m3 q (T::kE4m3Q): QK^T is an FP8 WGMMA on the staged boxes themselves and P V one on V^T,
// which the expander writes as e4m3 into tiles 4-7's space (transpose_page): the boxes stay as
// staged, and a page's V^T waits for nothing but its bytes and the release of the V^T before it.
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
    // bit b / 2 + b: buffer b's next bar_staged / bar_free phase
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

    __device__ __forceinline__ void wait_staged(int buf) {
        const uint32_t bar_staged = smem_u32(&st.bar_staged[buf]);
        if (idx == 0) mbarrier_arrive_expect_tx(bar_staged, kStagedPageBytes);
        mbarrier_wait(bar_staged, (phases >> buf) & 1);
        phases ^= 1u << buf;
    }

    // The consumers are done with what the page before last left in buffer `buf` (its V_R, or
    // an e4m3 q's V^T).
    __device__ __forceinline__ void wait_free(int buf) {
        mbarrier_wait(smem_u32(&st.bar_free[buf]), (phases >> (2 + buf)) & 1);
        phases ^= 4u << buf;
    }

    // The page in buffer `buf`, the `nth` page of its request (0, 1, ...), whose first `valid`
    // rows hold tokens.
    __device__ __forceinline__ void expand_page(int buf, int nth, int valid) {
        if constexpr (T::kE4m3Q) {
            transpose_page(buf, nth, valid);
            return;
        }
        wait_staged(buf);
        // Tiles from the first to expand down to 0, each tile's bytes read while the one before
        // is written (the reads touch no space a write overwrites before the barrier below it).
        constexpr int kFirst = kTilesK - 1;
        uint4 raw[2], next[2];
        read(buf, kFirst, valid, raw);
        CUTE_UNROLL
        for (int tile = kFirst; tile >= 0; --tile) {
            if (tile > 0) read(buf, tile - 1, valid, next);
            if (tile == kTilesV - 1 && nth >= 2) wait_free(buf);   // tiles 7..4 go where V_R was
            // Box 4 (tile 8's own bytes), boxes 3 and 2, boxes 1 and 0 are read by every thread.
            if (tile == kTilesK - 1 || tile == 3 || tile == 1) everyone_has_read();
            write(buf, tile, raw);
            raw[0] = next[0];
            raw[1] = next[1];
        }
    }

    // An e4m3 q: V^T of the page in buffer `buf` (e4m3, K-major, 64-byte swizzle; fp8_staged.cuh),
    // half 0 (columns 0-255) then half 1, each announced on its barrier (bar_kv[buf][half]). Its
    // rows' bytes follow the token order of P's registers (p_to_e4m3): byte 16 c + 4 q + i of a
    // row is token 16 c + 8 (i / 2) + 2 q + i % 2. Warp w takes box 2 half + w / 2 (128 columns)
    // and chunks c = 2 (w % 2) + {0, 1}: lane l reads bytes 4 l .. 4 l + 3 of the chunk's 16 token
    // rows (a whole 128-byte row per load instruction), transposes each 4 x 4 block of bytes with
    // byte permutes and writes the 16-byte chunk c of its four columns' rows. Lane l writes those
    // rows rotated by (l / 2) % 4, so that each quarter-warp's stores cover all eight 16-byte bank
    // slots. Rows from `valid` on (no token) read as zeros (their slots may hold NaN).
    __device__ __forceinline__ void transpose_page(int buf, int nth, int valid) {
        wait_staged(buf);
        if (nth >= 2) wait_free(buf);
        // The thread index read afresh: otherwise every token's address and bound, computed
        // from it, is hoisted out of the page loop (64 values: spilled).
        const int tid = thread_index_here() % 128;
        const int lane = tid % 32, warp = tid / 32;
        const uint32_t page = smem_u32(st.kv[buf]);
        uint32_t order[4], rows[4];             // output k: byte order[k] of the reads, into V^T row rows[k]
        CUTE_UNROLL
        for (int k = 0; k < 4; ++k) {
            order[k] = (k + lane / 2) % 4;
            rows[k] = 4 * lane + order[k];
        }
        // Byte selectors: [x0.o0, x1.o0, x0.o1, x1.o1] and the same for o2, o3.
        const uint32_t sel01 = order[0] | (4 + order[0]) << 4 | order[1] << 8 | (4 + order[1]) << 12;
        const uint32_t sel23 = order[2] | (4 + order[2]) << 4 | order[3] << 8 | (4 + order[3]) << 12;
        CUTE_UNROLL
        for (int half = 0; half < 2; ++half) {
            const int box = 2 * half + warp / 2;
            const uint32_t staged = page + staged_box_offset(box) + 4 * (lane % 4);
            const uint32_t vt = page + transposed_v_offset(half) + (box % 2) * (kTransposedVHalfBytes / 2);
            CUTE_UNROLL
            for (int u = 0; u < 2; ++u) {
                const int c = 2 * (warp % 2) + u;
                const uint32_t chunk_rows = staged + 16 * c * kFp8StagedRowBytes;
                const int chunk_valid = valid - 16 * c;
                uint32_t out[4][4];             // [k][q]: row rows[k], bytes 4 q .. 4 q + 3 of chunk c
                CUTE_UNROLL
                for (int q = 0; q < 4; ++q) {
                    uint32_t x[4];
                    CUTE_UNROLL
                    for (int i = 0; i < 4; ++i) {
                        const int token = 8 * (i / 2) + 2 * q + i % 2;      // of the chunk's 16
                        x[i] = token < chunk_valid ? load_shared_u32(swizzled_chunk(chunk_rows, token, lane / 4)) : 0u;
                    }
                    const uint32_t a01 = byte_perm(x[0], x[1], sel01), a23 = byte_perm(x[2], x[3], sel01);
                    const uint32_t b01 = byte_perm(x[0], x[1], sel23), b23 = byte_perm(x[2], x[3], sel23);
                    out[0][q] = byte_perm(a01, a23, 0x5410);
                    out[1][q] = byte_perm(a01, a23, 0x7632);
                    out[2][q] = byte_perm(b01, b23, 0x5410);
                    out[3][q] = byte_perm(b01, b23, 0x7632);
                }
                CUTE_UNROLL
                for (int k = 0; k < 4; ++k) {
                    store_shared(vt + sw64_offset(rows[k], 16 * c), make_uint4(out[k][0], out[k][1], out[k][2], out[k][3]));
                }
            }
            fence_smem_for_async_proxy();               // the consumers' WGMMAs read these stores
            __syncwarp();
            if (lane == 0) mbarrier_arrive(smem_u32(&st.bar_kv[buf][half]));
        }
    }
};

}  // namespace flashmla
