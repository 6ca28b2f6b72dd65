// Sparse decoding's producer warpgroup (KVCache::kFp8Sparse): gathers tokens and dequantizes them
// into the page buffers.
//
// A "page" is 64 consecutive entries of one query token's index list (IndexedTokens says where
// each row's token is). A token is DeepSeek-V3.2's 656 bytes: 512 e4m3 NoPE values, 4 float32
// scales (one per 128 values), 64 bf16 RoPE values. The producer loads each row's token,
// dequantizes the e4m3 values to fp16 and stores everything into a page buffer exactly as TMA
// stores a 16-bit page (nine 64 x 64 tiles, 128-byte swizzle), so the consumers' WGMMAs are the
// 16-bit kernel's. Skipped rows (id < 0, id outside the cache, position past topk_length) get
// zeros and a 0 bit in token_valid.
//
// Pairs (FlashMLA's "crossover"): with two m-blocks the two CTAs of a request form a cluster and
// read the same tokens. Each dequantizes half of every page (rows 32r .. 32r + 31 for rank r)
// into its own page buffer and, by st.async, into its peer's, whose tile barriers count those
// bytes. A CTA alone (one m-block) dequantizes both halves. The bf16 RoPE tile is copied by
// every CTA for all 64 rows itself (cp.async, no registers).
//
// Hand-off per page buffer: the producer waits for the release by every consumer warpgroup of
// the cluster (bar_free), fills tiles 0-3, one arrival per producer warp on each of their full
// barriers (bar_kv), then tiles 4-8 the same way: S = Q K^T starts on the first group while the
// second is stored. Global loads run ahead of the stores (fill_pages).
//
// Lanes: for rows 32r .. 32r + 31 each warp owns 8 rows; lane = row (lane % 8) x part (lane / 8),
// and part j moves 16-byte chunks j, j + 4, ... of its token's row, so that one warp-wide store
// writes 4 chunks into each of 8 swizzled rows without bank conflicts.
#pragma once
#include <cuda/std/cstdint>

#include "common/error.cuh"
#include "common/numeric.cuh"
#include "common/sync.cuh"
#include "mla/config.cuh"
#include "mla/params.cuh"

namespace flashmla {

__device__ __forceinline__ uint4 load_token_chunk(const uint8_t* ptr) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

// 16 bytes global -> shared without registers; `valid` false writes zeros and reads nothing.
__device__ __forceinline__ void copy_chunk_async(uint32_t dst, const uint8_t* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}

__device__ __forceinline__ uint32_t fp16x2_mul(uint32_t a, uint32_t b) {
    uint32_t out;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(b));
    return out;
}

__device__ __forceinline__ uint32_t fp16x2_splat(float x) {
    uint32_t out;
    asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(out) : "f"(x));
    return out;
}

// The byte offset of a row without a token (zeros).
constexpr int64_t kSkippedToken = -1;

// The entries of one query token's index list (the first `visible` count). An entry is read two
// pages ahead of its use (entry), its byte offset one page ahead (offset).
struct IndexedTokens {
    const int* ids;
    int visible;

    __device__ __forceinline__ int entry(int page, int row) const {
        const int t = page * kBlockN + row;
        return t < visible ? ids[t] : -1;
    }
    // Token id -> byte offset; a negative id or one past the cache is skipped.
    __device__ __forceinline__ int64_t offset(const SplitKVParams& p, int id) const {
        const bool valid = id >= 0 && id < p.cache_tokens;
        return valid ? (int64_t)(id / p.page_block_size) * p.cache_block_stride +
                       (int64_t)(id % p.page_block_size) * kFp8TokenBytes
                     : kSkippedToken;
    }
};

// What one lane loads of its token for a half page: NoPE chunks part + 4t (t = the V tile) and
// the token's four scales.
struct TokenLoads {
    uint4 nope[kTilesV];
    uint4 scales;
};

template <typename T>
struct Fp8Producer {
    static_assert(T::kSparse, "the dense FP8 cache's pages are staged by TMA and expanded in place (fp8_expand.cuh)");
    static constexpr uint32_t kTileBytes = 64 * kTileCols * 2;
    static constexpr uint32_t kPeerTileBytes = kTileBytes / 2;   // the peer's half of a tile

    const SplitKVParams& p;
    typename T::SharedStorage& st;
    const int warp, lane;                 // warp within the producer warpgroup
    const uint32_t rank, ranks;           // this CTA's rank in its cluster; CTAs in it (1 or 2)
    const uint32_t peer_offset;           // shared::cluster address of the peer's byte minus ours
    uint32_t free_phase = 0;              // bit b: phase of page buffer b's next bar_free wait

    __device__ __forceinline__ Fp8Producer(const SplitKVParams& params, typename T::SharedStorage& storage)
        : p(params), st(storage), warp((threadIdx.x / 32) % 4), lane(threadIdx.x % 32),
          rank(cluster_rank()), ranks(cluster_size()),
          peer_offset(cluster_size() == 2 ? peer_address(smem_u32(&storage), cluster_rank() ^ 1) - smem_u32(&storage)
                                          : 0) {}

    // Shared address of 16-byte chunk `chunk` (of 8) of row `row` of a 128-byte-swizzled tile.
    __device__ __forceinline__ uint32_t chunk_address(int buf, int tile, int row, int chunk) const {
        return smem_u32(st.kv[buf]) + tile * kTileBytes + row * 128 + ((chunk ^ (row % 8)) * 16);
    }

    // The lane's part of one token (byte offset `off` in the cache; < 0: no token, zeros).
    __device__ __forceinline__ TokenLoads load_token(int64_t off) const {
        TokenLoads t;
        const bool valid = off >= 0;
        const uint4 zero = make_uint4(0, 0, 0, 0);
        const uint8_t* src = p.cache + (valid ? off : 0);
        const int part = lane / 8;
        CUTE_UNROLL
        for (int tile = 0; tile < kTilesV; ++tile) {
            t.nope[tile] = valid ? load_token_chunk(src + 16 * (part + 4 * tile)) : zero;
        }
        t.scales = valid ? load_token_chunk(src + kHeadDimV) : zero;
        return t;
    }

    // 16 bytes into chunk `chunk` of row `row` of a tile, here and, in a pair, at the peer (whose
    // barrier of that tile counts the bytes).
    __device__ __forceinline__ void store_chunk(int buf, int tile, int row, int chunk, uint4 v) const {
        const uint32_t dst = chunk_address(buf, tile, row, chunk);
        store_shared(dst, v);
        if (ranks == 2) store_peer_async(dst + peer_offset, v, smem_u32(&st.bar_kv[buf][tile]) + peer_offset);
    }

    // 16 e4m3 values (one chunk) times `scale2` -> 2 fp16 chunks, 2 part and 2 part + 1, of row
    // `row` of a tile.
    __device__ __forceinline__ void store_dequantized(int buf, int tile, int row, uint4 raw, uint32_t scale2) const {
        const int part = lane / 8;
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t h[8];
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
            h[2 * j] = fp16x2_mul(e4m3x2_to_fp16x2(w[j] & 0xffffu), scale2);
            h[2 * j + 1] = fp16x2_mul(e4m3x2_to_fp16x2(w[j] >> 16), scale2);
        }
        store_chunk(buf, tile, row, 2 * part, make_uint4(h[0], h[1], h[2], h[3]));
        store_chunk(buf, tile, row, 2 * part + 1, make_uint4(h[4], h[5], h[6], h[7]));
    }

    // The NoPE tiles of group kGroup (0: tiles 0-3; 1: tiles 4-7) of row `row`, 16 values per
    // lane and tile.
    template <int kGroup>
    __device__ __forceinline__ void store_token(int buf, int row, const TokenLoads& t) const {
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
            const int tile = 4 * kGroup + i;
            // tile t holds NoPE values 64t .., whose scale is number t / 2
            const uint4 e = t.scales;
            const uint32_t scale_bits = tile / 2 == 0 ? e.x : tile / 2 == 1 ? e.y : tile / 2 == 2 ? e.z : e.w;
            store_dequantized(buf, tile, row, t.nope[tile], fp16x2_splat(__uint_as_float(scale_bits)));
        }
    }

    // The RoPE tile (bf16, as cached) of all 64 rows, by cp.async: no registers, and the page's
    // only loads whose latency the stores wait for. `offsets` as lane_row spreads them.
    __device__ __forceinline__ void copy_rope(int buf, int64_t offsets) const {
        const int part = lane / 8;
        CUTE_UNROLL
        for (int half = 0; half < 2; ++half) {
            const int row = 32 * half + 8 * warp + lane % 8;
            const int64_t off = half_offset(offsets, half);
            const uint8_t* src = p.cache + (off >= 0 ? off : 0) + kFp8RopeOffset;
            CUTE_UNROLL
            for (int c = 0; c < 2; ++c) {
                copy_chunk_async(chunk_address(buf, kTilesK - 1, row, part + 4 * c), src + 16 * (part + 4 * c), off >= 0);
            }
        }
    }

    // Wait until every consumer warpgroup of the cluster has released page buffer `buf`. The
    // first wait on each buffer passes at once (the phase "before" a fresh barrier's first).
    __device__ __forceinline__ void wait_free(int buf) {
        mbarrier_wait(smem_u32(&st.bar_free[buf]), ((free_phase >> buf) & 1) ^ 1);
        free_phase ^= 1u << buf;
    }

    // The group's tiles are complete in this CTA (warp 0 announces the peer's bytes of a pair).
    template <int kGroup>
    __device__ __forceinline__ void publish(int buf) const {
        if constexpr (kGroup == 1) cp_async_wait_all();
        fence_smem_for_async_proxy();           // the consumers' WGMMAs read these stores
        __syncwarp();
        if (lane == 0) {
            CUTE_UNROLL
            for (int tile = 4 * kGroup; tile < (kGroup == 0 ? 4 : kTilesK); ++tile) {
                const uint32_t bar = smem_u32(&st.bar_kv[buf][tile]);
                if (ranks == 2 && warp == 0 && tile < kTilesV) {   // the peer's stores (RoPE: its own copy)
                    mbarrier_arrive_expect_tx(bar, kPeerTileBytes);
                } else {
                    mbarrier_arrive(bar);
                }
            }
        }
    }

    // This lane's row of a page (its entries): lanes 0-15 (and again 16-31) hold rows
    // 8 warp + lane % 8 and 32 + 8 warp + lane % 8.
    __device__ __forceinline__ int lane_row() const { return 8 * warp + lane % 8 + 32 * ((lane / 8) & 1); }

    // This lane's token in rows 32 half .., from a page's offsets (as lane_row spreads them).
    __device__ __forceinline__ int64_t half_offset(int64_t offsets, int half) const {
        return __shfl_sync(0xffffffffu, offsets, 8 * half + lane % 8);
    }

    // Pages [first_page, end_page) of `tokens`, alternating between the page
    // buffers. The work comes in half pages (one per page in a pair, two alone); the loads of the
    // next half page are in flight while this one is stored, and the entries are read two pages
    // ahead.
    __device__ __forceinline__ void fill_pages(const IndexedTokens& tokens, int first_page, int end_page) {
        if (first_page >= end_page) return;
        const int first_half = ranks == 2 ? rank : 0, halves = ranks == 2 ? 1 : 2;
        const int my_row = lane_row();
        int64_t offsets = tokens.offset(p, tokens.entry(first_page, my_row));
        int next_entry = first_page + 1 < end_page ? tokens.entry(first_page + 1, my_row) : kSkippedToken;
        TokenLoads current = load_token(half_offset(offsets, first_half));
        #pragma unroll 1
        for (int page = first_page; page < end_page; ++page) {
            const int buf = (page - first_page) & 1;
            const int64_t next_offsets = page + 1 < end_page ? tokens.offset(p, next_entry)
                                                             : kSkippedToken;
            next_entry = page + 2 < end_page ? tokens.entry(page + 2, my_row) : kSkippedToken;
            const uint32_t bits = __ballot_sync(0xffffffffu, offsets >= 0);
            #pragma unroll 1
            for (int h = 0; h < halves; ++h) {
                const int half = first_half + h;
                const bool last = h == halves - 1;
                const TokenLoads next = load_token(last ? half_offset(next_offsets, first_half)
                                                        : half_offset(offsets, half + 1));
                if (h == 0) {
                    wait_free(buf);
                    if (lane == 0) {           // byte b of the mask: rows 8b .. 8b + 7
                        st.token_valid[buf][warp] = static_cast<uint8_t>(bits);
                        st.token_valid[buf][4 + warp] = static_cast<uint8_t>(bits >> 8);
                    }
                    copy_rope(buf, offsets);
                }
                const int row = 32 * half + 8 * warp + lane % 8;
                store_token<0>(buf, row, current);
                if (last) publish<0>(buf);
                store_token<1>(buf, row, current);
                if (last) publish<1>(buf);
                current = next;
            }
            offsets = next_offsets;
        }
    }
};

}  // namespace flashmla
