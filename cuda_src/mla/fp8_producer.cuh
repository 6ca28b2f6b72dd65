// Sparse decoding's producer warpgroup (KVCache::kFp8Sparse): gathers tokens and dequantizes them
// into the page buffers.
//
// A "page" is 64 consecutive entries of one query token's index list (IndexedTokens says where
// each row's token is). A token is DeepSeek-V3.2's 656 bytes: 512 e4m3 NoPE values, 4 float32
// scales (one per 128 values), 64 bf16 RoPE values. The producer loads each row's token,
// dequantizes the e4m3 values to fp16 and fills a page buffer exactly as TMA stores a 16-bit
// page (nine 64 x 64 tiles, 128-byte swizzle), so the consumers' WGMMAs are the 16-bit kernel's.
// Skipped rows (id < 0, id outside the cache, position past topk_length) get zeros and a 0 bit
// in token_valid.
//
// Pairs (FlashMLA's "crossover"): with two m-blocks the two CTAs of a request form a cluster and
// read the same tokens. Each dequantizes half of every page (rows 32r .. 32r + 31 for rank r)
// into its own page buffer; each warp then has the bulk-copy engine copy its 8 finished rows of
// each NoPE tile (1 KB, contiguous) into the peer's buffer, whose tile barriers count those
// bytes. (Per thread st.async of each 16-byte chunk, as FlashMLA does, doubled the producer's
// shared-memory instructions and stalled the whole SM's MIO queues: docs/perf-notes.md section
// 19.) A CTA alone (one m-block) dequantizes both halves. The bf16 RoPE values (tile 8) go by
// cp.async straight into the page buffer, every row by each CTA (copy_rope): no registers held
// for them, no bulk copy, and the registers left go to the scores warpgroup in pairs (Q's tile 0).
//
// Hand-off per page buffer: the producer waits for the release of tiles 0-3 by the cluster's
// consumers (bar_free: each tile group is released by the warpgroups that read it last), fills
// them, one arrival per producer warp on their full barriers (bar_kv: one per tile, or one for the
// group in the form for CTAs alone), then tiles 4-8 the same way (tile 8 by cp.async, counted
// on the same barriers): S = Q K^T starts on the first group while the second is stored. Global
// loads run a half page ahead of the stores (fill_pages), so that after a release only the
// stores stand between the producer and the next hand-off, and each token is prefetched into L2
// two pages ahead of its loads: a half page of loads in flight (all the registers allow) waits
// out DRAM's latency otherwise (docs/perf-notes.md section 20).
//
// Lanes: for rows 32r .. 32r + 31 each warp owns 8 rows; lane = row (lane % 8) x part (lane / 8),
// and part j moves 16-byte chunks j, j + 4, ... of its token's row, so that one warp-wide store
// writes 4 chunks into each of 8 swizzled rows without bank conflicts.
#pragma once
#include <cuda/std/cstdint>

#include "common/error.cuh"
#include "common/numeric.cuh"
#include "common/sync.cuh"
#include "common/tma.cuh"
#include "mla/config.cuh"
#include "mla/params.cuh"

namespace flashmla {

__device__ __forceinline__ uint4 load_token_chunk(const uint8_t* ptr) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

// The byte offset of a row without a token (zeros).
constexpr int64_t kSkippedToken = -1;

// The entries of one query token's index list (the first `visible` count). An entry is read three
// pages ahead of its use (entry), its byte offset computed (offset) and its token prefetched into
// L2 two pages ahead.
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
        // where it counts both are >= 0: unsigned division, fewer instructions
        const uint32_t token = id, page_size = p.page_block_size;
        return valid ? (int64_t)(token / page_size) * p.cache_block_stride +
                       (int64_t)(token % page_size) * kFp8TokenBytes
                     : kSkippedToken;
    }
};

// What one lane loads of its token for a half page: NoPE chunks part + 4t (t = the V tile) and
// the token's four scales. (The RoPE values go by cp.async: copy_rope.)
struct TokenLoads {
    uint4 nope[kTilesV];
    uint4 scales;
};

template <typename T>
struct Fp8Producer {
    static_assert(T::kSparse, "the dense FP8 cache's pages are staged by TMA and expanded in place (fp8_expand.cuh)");
    static constexpr uint32_t kPeerTileBytes = kFp16TileBytes / 2;   // the peer's half of a tile

    const SplitKVParams& p;
    typename T::SharedStorage& st;
    const int warp, lane;                 // warp within the producer warpgroup
    const uint32_t rank, ranks;           // this CTA's rank in its cluster; CTAs in it (1 or 2)
    const uint32_t peer_offset;           // shared::cluster address of the peer's byte minus ours
    uint32_t free_phase = 0;              // bit b: phase of bar_free[b]'s next wait

    __device__ __forceinline__ Fp8Producer(const SplitKVParams& params, typename T::SharedStorage& storage)
        : p(params), st(storage), warp((threadIdx.x / 32) % 4), lane(threadIdx.x % 32),
          rank(cluster_rank()), ranks(cluster_size()),
          peer_offset(cluster_size() == 2 ? peer_address(smem_u32(&storage), cluster_rank() ^ 1) - smem_u32(&storage)
                                          : 0) {}

    // Shared address of 16-byte chunk `chunk` (of 8) of row `row` of a 128-byte-swizzled tile.
    __device__ __forceinline__ uint32_t chunk_address(int buf, int tile, int row, int chunk) const {
        return swizzled_chunk(smem_u32(st.kv[buf]) + tile * kFp16TileBytes, row, chunk);
    }

    // The lane's part of one token (byte offset `off` in the cache; < 0: no token, zeros).
    __device__ __forceinline__ TokenLoads load_token(int64_t off) const {
        TokenLoads t;
        const bool valid = off >= 0;
        const uint4 zero = make_uint4(0, 0, 0, 0);
        const uint8_t* token = p.cache + (valid ? off : 0);
        // this lane's chunks, 64 bytes apart (one address register: left to itself, ptxas
        // rebuilds p.cache + off + offset for every load)
        const uint8_t* chunks = computed_here(token + 16 * (lane / 8));
        CUTE_UNROLL
        for (int tile = 0; tile < kTilesV; ++tile) {
            t.nope[tile] = valid ? load_token_chunk(chunks + 64 * tile) : zero;
        }
        t.scales = valid ? load_token_chunk(token + kHeadDimV) : zero;
        return t;
    }

    // 16 e4m3 values (one chunk) times `scale2` -> 2 fp16 chunks, 2 part and 2 part + 1, of row
    // `row` of a tile.
    __device__ __forceinline__ void store_dequantized(int buf, int tile, int row, uint4 raw, uint32_t scale2) const {
        const int part = lane / 8;
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        CUTE_UNROLL
        for (int half = 0; half < 2; ++half) {
            const Fp16x2Pair x = e4m3x4_to_fp16x2(w[2 * half]), y = e4m3x4_to_fp16x2(w[2 * half + 1]);
            store_shared(chunk_address(buf, tile, row, 2 * part + half),
                         make_uint4(fp16x2_mul(x.lo, scale2), fp16x2_mul(x.hi, scale2),
                                    fp16x2_mul(y.lo, scale2), fp16x2_mul(y.hi, scale2)));
        }
    }

    // Group kGroup of row `row`: 0, NoPE tiles 0-3; 1, NoPE tiles 4-7. 16 values per lane and tile.
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

    // The RoPE tile (8) of page buffer `buf`: all 64 rows' bf16 values as cached, by cp.async
    // (no registers held, and in a pair no bulk copy: each CTA copies every row). The lane takes
    // chunks part and part + 4 of rows 8 warp + lane % 8 and that + 32 (`offsets` as lane_row
    // spreads them); the tile's barrier counts one arrival per producer thread, made once its
    // copies have landed.
    __device__ __forceinline__ void copy_rope(int buf, int64_t offsets) const {
        const int part = lane / 8;
        CUTE_UNROLL
        for (int half = 0; half < 2; ++half) {
            const int64_t off = half_offset(offsets, half);
            const uint8_t* rope = p.cache + (off >= 0 ? off + kFp8RopeOffset : 0);
            const int row = 32 * half + 8 * warp + lane % 8;
            CUTE_UNROLL
            for (int c = 0; c < 2; ++c) {
                const int chunk = part + 4 * c;
                cp_async_16(chunk_address(buf, kTilesK - 1, row, chunk), rope + 16 * chunk, off >= 0 ? 16 : 0);
            }
        }
        cp_async_arrive_noinc(smem_u32(&st.bar_kv[buf][T::kv_barrier(kTilesK - 1)]));
    }

    // Wait until the cluster's consumers have released tile group kGroup of page buffer `buf`
    // (SplitKVTraits::free_barrier). The first wait on each passes at once (the phase "before" a
    // fresh barrier's first).
    template <int kGroup>
    __device__ __forceinline__ void wait_free(int buf) {
        const int bar = T::free_barrier(kGroup, buf);
        mbarrier_wait(smem_u32(&st.bar_free[bar]), ((free_phase >> bar) & 1) ^ 1);
        free_phase ^= 1u << bar;
    }

    // The group's tiles are complete in this CTA, and in a pair this warp's rows (8, from
    // `first_row`) of them are on their way to the peer. Warp 0 announces the bytes the peer's
    // warps send here, on each barrier the bytes of its tiles (SplitKVTraits::kv_barrier).
    template <int kGroup>
    __device__ __forceinline__ void publish(int buf, int first_row) const {
        fence_smem_for_async_proxy();           // the consumers' WGMMAs and the bulk copies read these stores
        __syncwarp();
        constexpr int kFirstTile = 4 * kGroup, kEndTile = kGroup == 0 ? 4 : kTilesK;
        constexpr int kTilesPerBarrier = T::kGroupBarriers ? kEndTile - kFirstTile : 1;
        if (lane == 0) {
            CUTE_UNROLL
            for (int tile = kFirstTile; tile < kEndTile; tile += kTilesPerBarrier) {
                const uint32_t bar = smem_u32(&st.bar_kv[buf][T::kv_barrier(tile)]);
                // the RoPE tile is copied by each CTA itself (copy_rope)
                const int peer_tiles = min(tile + kTilesPerBarrier, kTilesK - 1) - tile;
                if (ranks == 2) {
                    CUTE_UNROLL
                    for (int t = tile; t < tile + peer_tiles; ++t) {
                        const uint32_t rows = chunk_address(buf, t, first_row, 0);
                        copy_to_peer_async(rows + peer_offset, rows, 8 * kSwizzleRowBytes, bar + peer_offset);
                    }
                }
                if (ranks == 2 && warp == 0 && peer_tiles > 0) {
                    mbarrier_arrive_expect_tx(bar, peer_tiles * kPeerTileBytes);
                } else {
                    mbarrier_arrive(bar);
                }
            }
        }
    }

    // This lane's row of a page (its entries): lanes 0-15 (and again 16-31) hold rows
    // 8 warp + lane % 8 and 32 + 8 warp + lane % 8.
    __device__ __forceinline__ int lane_row() const { return 8 * warp + lane % 8 + 32 * ((lane / 8) & 1); }

    // This lane's entry of `page` (lane_row's), none (-1) past the part's pages.
    __device__ __forceinline__ int lane_entry(const IndexedTokens& tokens, int page, int end_page) const {
        return page < end_page ? tokens.entry(page, lane_row()) : -1;
    }

    // This lane's token in rows 32 half .., from a page's offsets (as lane_row spreads them).
    __device__ __forceinline__ int64_t half_offset(int64_t offsets, int half) const {
        return __shfl_sync(0xffffffffu, offsets, 8 * half + lane % 8);
    }

    // Where fill_pages is: token offsets (as lane_row spreads them) of the current page, of the
    // next and of the one after it (prefetched), and this lane's entry a page further.
    struct Cursor {
        int64_t offsets, next_offsets, ahead_offsets;
        int ahead_entry;
    };

    // Into L2: this lane's share of its token of a page (at `off`) if this CTA loads its row.
    // Lanes l and l + 16 hold the same row (lane_row); a token (656 bytes) spans at most six
    // 128-byte lines, lines 0, 2, 4 for the first lane and 1, 3, 5 for the second. A pair's CTA
    // loads half `rank` of each page. (One bulk prefetch per token takes uniform operands: ptxas
    // loops over the lanes.)
    __device__ __forceinline__ void prefetch_row(int64_t off) const {
        const bool mine = ranks == 1 || ((lane / 8) & 1) == static_cast<int>(rank);
        if (mine && off >= 0) {
            CUTE_UNROLL
            for (int line = lane / 16; line < 6; line += 2) prefetch_l2(p.cache + off + 128 * line);
        }
    }

    // Step k of fill_pages: half page k % halves of page first_page + k / halves (halves: 1 in a
    // pair, 2 alone), stored from `current` while the next step's half page loads into `next`.
    __device__ __forceinline__ void fill_step(const IndexedTokens& tokens, int first_page, int end_page, int k,
                                              Cursor& c, const TokenLoads& current, TokenLoads& next) {
        const int log2_halves = ranks == 2 ? 0 : 1, first_half = ranks == 2 ? rank : 0;
        const int page = first_page + (k >> log2_halves), h = k & log2_halves;
        const int buf = (page - first_page) & 1, half = first_half + h;
        const bool last = h == log2_halves;
        if (h == 0) {
            c.next_offsets = c.ahead_offsets;
            c.ahead_offsets = tokens.offset(p, c.ahead_entry);     // skipped past the end
            prefetch_row(c.ahead_offsets);
            c.ahead_entry = lane_entry(tokens, page + 3, end_page);
        }
        next = load_token(last ? half_offset(c.next_offsets, first_half) : half_offset(c.offsets, half + 1));
        if (h == 0) {
            const uint32_t bits = __ballot_sync(0xffffffffu, c.offsets >= 0);
            wait_free<0>(buf);
            if (lane == 0) {           // byte b of the mask: rows 8b .. 8b + 7
                st.token_valid[buf][warp] = static_cast<uint8_t>(bits);
                st.token_valid[buf][4 + warp] = static_cast<uint8_t>(bits >> 8);
            }
        }
        const int first_row = 32 * half + 8 * warp, row = first_row + lane % 8;
        store_token<0>(buf, row, current);
        if (last) publish<0>(buf, first_row);
        if (h == 0) {
            wait_free<1>(buf);
            copy_rope(buf, c.offsets);
        }
        store_token<1>(buf, row, current);
        if (last) {
            publish<1>(buf, first_row);
            c.offsets = c.next_offsets;
        }
    }

    // Pages [first_page, end_page) of `tokens`, alternating between the page buffers. The work
    // comes in steps of half a page; each step stores what the step before loaded and loads for
    // the next, so two TokenLoads take turns (copying one into the other would wait for its
    // loads). The entries are read three pages ahead, their tokens prefetched two ahead.
    __device__ __forceinline__ void fill_pages(const IndexedTokens& tokens, int first_page, int end_page) {
        if (first_page >= end_page) return;
        const int steps = (end_page - first_page) << (ranks == 2 ? 0 : 1);
        // The first three pages' entries are loaded together, before any offset is computed:
        // computed in between, each waited for the one before it, a DRAM round trip more on every
        // part's way to its first page (docs/perf-notes.md section 53).
        const int entry0 = lane_entry(tokens, first_page, end_page), entry1 = lane_entry(tokens, first_page + 1, end_page),
                  entry2 = lane_entry(tokens, first_page + 2, end_page);
        Cursor c{tokens.offset(p, entry0), kSkippedToken, tokens.offset(p, entry1), entry2};
        // Page 0's loads go out before page 1's prefetches, ahead of them in the memory queues:
        // every part starts at once after the flush, and its first page waits for them (0.45 us
        // sooner at batch 2; the same order in fill_step slows the long rows, docs/perf-notes.md
        // section 54).
        TokenLoads a = load_token(half_offset(c.offsets, ranks == 2 ? rank : 0)), b;
        prefetch_row(c.ahead_offsets);
        #pragma unroll 1
        for (int k = 0; k < steps; k += 2) {
            fill_step(tokens, first_page, end_page, k, c, a, b);
            if (k + 1 < steps) fill_step(tokens, first_page, end_page, k + 1, c, b, a);
        }
    }
};

}  // namespace flashmla
