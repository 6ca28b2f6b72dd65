// The dense FP8 cache's third warpgroup: expands pages that TMA staged, e4m3, inside the page
// buffers (fp8_staged.cuh) into the fp16 tiles the seesaw's WGMMAs read.
//
// The seesaw frees a staged page's boxes before V_R (tiles 4-7): tiles 0-3 once V_L is consumed,
// tile 8 once QK^T is done, which is where the consumers stage the page after next
// (load_page_tiles<0, 4>), or at one-token pages announce it to the expander, which stages the
// page itself before expanding it (SplitKVCta::stage_for_expander).
//
// Order, bf16 q: tile 8 (its own box) as soon as the bytes are in; then, once warpgroup 1
// released V_R (bar_free; a request's first two pages are staged only after every consumer left
// the previous request), tiles 7..4, whose space holds no box; tiles 3, 2 into boxes 3, 2 once
// every thread has read those; tiles 1, 0 into boxes 1, 0 likewise. The consumers' QK^T takes
// the tiles in this order (SplitKVTraits::kQkFromLastTile).
// An e4m3 q (T::kE4m3Q): QK^T is an FP8 WGMMA on the staged boxes themselves and P V one on V^T,
// which the expander writes as e4m3 into a ring of three V^T buffers (transpose_page): the boxes
// stay as staged, and a page's V^T waits for nothing but its bytes and the release of the V^T
// three pages back.
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
    const Fp16x2Pair x = e4m3x4_to_fp16x2(raw.x), y = e4m3x4_to_fp16x2(raw.y);
    const Fp16x2Pair z = e4m3x4_to_fp16x2(raw.z), w = e4m3x4_to_fp16x2(raw.w);
    store_shared(swizzled_chunk(tile, row, 2 * part), make_uint4(x.lo, x.hi, y.lo, y.hi));
    store_shared(swizzled_chunk(tile, row, 2 * part + 1), make_uint4(z.lo, z.hi, w.lo, w.hi));
}

template <typename T>
struct Fp8Expander {
    static constexpr int kExpandBarrier = 9;        // the expander's own named barrier (WgBarrier: 1-8)

    typename T::SharedStorage& st;
    const int idx;                                  // thread within the warpgroup
    // bit b: page buffer b's next bar_staged phase; bit 2 + b: bar_free[b]'s (page buffer b's
    // V_R, or an e4m3 q's V^T buffer b)
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
        mbarrier_wait(smem_u32(&st.bar_staged[buf]), (phases >> buf) & 1);
        phases ^= 1u << buf;
    }

    // The consumers are done with what the page before last left in buffer `buf` (its V_R), or
    // an e4m3 q's with V^T buffer `buf` (three pages back).
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

    // An e4m3 q: V^T of the page staged in buffer `buf`, the `nth` of its request (e4m3, K-major,
    // 64-byte swizzle; fp8_staged.cuh), into V^T buffer nth % 3 once the consumers are done with
    // the page three back there; half 0 (columns 0-255) then half 1, each announced on its
    // barrier (bar_kv[0][2 v + half] for buffer v). Its rows' bytes follow the token order of
    // P's registers (p_to_e4m3): byte 4 q + i of a row's
    // 16-byte group g is token 16 g + 8 (i / 2) + 2 q + i % 2, which is what a transposing
    // ldmatrix gives when its 16-bit elements are read as pairs of e4m3 columns: lane l holds
    // columns 2 (l / 4) and 2 (l / 4) + 1 of tokens 2 (l % 4), 2 (l % 4) + 1 of the matrix of 8
    // tokens (16 columns) it loaded, so two byte permutes of the matrices of tokens 16 g .. + 7
    // and 16 g + 8 .. + 15 give word l % 4 of group g of both columns' rows, as stmatrix stores
    // them. Lanes l / 4 >= 4 swap the two columns between the stored matrices, so that each
    // matrix's eight rows fall on the eight 16-byte bank slots of the 64-byte swizzle (rows n and
    // n + 8 share theirs). Warp w takes columns 64 w .. 64 w + 63 of each half, 16 columns by 32
    // tokens per ldmatrix. Tokens from `valid` on read as zeros (their slots may hold NaN).
    __device__ __forceinline__ void transpose_page(int buf, int nth, int valid) {
        const int vt_buf = nth % kTransposedVBuffers;
        wait_staged(buf);
        if (nth >= kTransposedVBuffers) wait_free(vt_buf);
        // The thread index read afresh, as everywhere in the expander's page loop.
        const int tid = thread_index_here() % 128;
        const int lane = tid % 32, warp = tid / 32;
        const uint32_t page = smem_u32(st.kv[buf]);
        const int pair = lane / 4, word = lane % 4;
        const uint32_t even_first = 0x6420, odd_first = 0x7531;   // [a.b0 a.b2 b.b0 b.b2], [a.b1 a.b3 b.b1 b.b3]
        const uint32_t sel0 = pair < 4 ? even_first : odd_first, sel1 = pair < 4 ? odd_first : even_first;
        // ldmatrix: lane l addresses token 8 (l / 8) + l % 8 of 32; stmatrix: row l % 8 of
        // matrix l / 8, the columns' rows as swapped above, in group (l / 16) of the two.
        const uint32_t store_column = 2 * (lane % 8) + (((lane / 8) % 2) ^ (lane % 8 >= 4));
        const uint32_t store_group = lane / 16;
        CUTE_UNROLL
        for (int half = 0; half < 2; ++half) {
            const uint32_t staged = page + staged_box_offset(2 * half + warp / 2);
            const uint32_t vt = smem_u32(transposed_v_buffer<T>(st, vt_buf)) + half * kTransposedVHalfBytes;
            // All eight loads before the stores (the asm keeps program order): one at a time,
            // each waited for before its store, left the expander latency-bound.
            uint32_t r[8][4];
            CUTE_UNROLL
            for (int k = 0; k < 8; ++k) {              // columns 16 (k / 2) .. of the warp's 64, tokens 32 (k % 2) ..
                ldmatrix_x4_trans(r[k], swizzled_chunk(staged, 32 * (k % 2) + lane, 4 * (warp % 2) + k / 2));
            }
            CUTE_UNROLL
            for (int k = 0; k < 8; ++k) {
                uint32_t out[4] = {byte_perm(r[k][0], r[k][1], sel0), byte_perm(r[k][0], r[k][1], sel1),
                                   byte_perm(r[k][2], r[k][3], sel0), byte_perm(r[k][2], r[k][3], sel1)};
                if (valid < kBlockN) {
                    CUTE_UNROLL
                    for (int g = 0; g < 2; ++g) {
                        const int token = 32 * (k % 2) + 16 * g + 2 * word;
                        const uint32_t keep = (token < valid ? 0xffu : 0u) | (token + 1 < valid ? 0xff00u : 0u) |
                                              (token + 8 < valid ? 0xff0000u : 0u) | (token + 9 < valid ? 0xff000000u : 0u);
                        out[2 * g] &= keep;
                        out[2 * g + 1] &= keep;
                    }
                }
                const uint32_t row = 64 * warp + 16 * (k / 2) + store_column;        // of the half
                stmatrix_x4(vt + sw64_offset(row, 16 * (2 * (k % 2) + store_group)), out[0], out[1], out[2], out[3]);
            }
            fence_smem_for_async_proxy();               // the consumers' WGMMAs read these stores
            __syncwarp();
            if (lane == 0) mbarrier_arrive(smem_u32(&st.bar_kv[0][2 * vt_buf + half]));
        }
    }
};

}  // namespace flashmla
