// Split-KV MLA decoding kernel ("seesaw" schedule of FlashMLA's 2025-04-22 kernel).
//
// Grid: (ceil(q_rows / 64), h_kv, num_sm_parts), 384 threads, one CTA per SM. CTA (m, h, part)
// handles query rows [64m, 64m + 64) of kv head h for the (request, page range) list that the
// tile scheduler gave to `part`. Per request the two consumer warpgroups walk the pages in pairs:
//
//   page buffers kv[0] (even page) and kv[1] (odd page), each 64 x 576, loaded by TMA as nine
//   64 x 64 tiles, each with its own mbarrier so that S = Q K^T starts on the first tile;
//   warpgroup 0: S0 = Q K0^T, softmax, O_L += P0 V0_L, then O_L += P1 V1_L (P1 from smem);
//   warpgroup 1: S1 = Q K1^T, softmax, O_R += P1 V1_R, then O_R += P0 V0_R (P0 from smem);
//   the next pair's tiles are requested once the tile they replace has been consumed: at once
//   where the pages feed this CTA alone (loads_bound), otherwise at FlashMLA's points. There the
//   consumer only arrives on a barrier; the four warps of the third warpgroup issue the loads
//   (run_loads), so that no consumer warp spends time on TMA issue (docs/perf-notes.md section 37).
//
// A page here is kBlockN = 64 tokens of the request. The cache's pages (page_block_size, a power
// of two) fill a page buffer as 64 / page_block_size whole pages, or as a 64-token slice of a
// larger one: each piece is one TMA box per tile, issued by its own lane (load_page_tiles).
// One-token pages (T::kTokenPages, a program of its own) are copied with cp.async instead: by
// the loader lanes (load_token_tiles), or for the dense FP8 cache by the warps of the
// warpgroup that stages the page (copy_staged_tokens): with an e4m3 q the consumer warpgroup
// that frees it, with a bf16 q the expander (stage_for_expander).
//
// splitkv_softmax.cuh explains the shared running max; FlashMLA's deep-dive (docs/20250422-new-
// kernel-deep-dive.md in its repository) explains the schedule.
//
// FP8 forms (T::kProducer), 384 threads: a third warpgroup fills the page buffers with fp16
// values. The dense FP8 cache (KVCache::kFp8): the requests, pages and seesaw above; TMA stages
// each page's e4m3 bytes inside its own page buffer where the seesaw has freed it, and the third
// warpgroup expands them in place (fp8_expand.cuh); the scale multiplies the scores and O. With an
// e4m3 q (T::kE4m3Q), Q is staged the same way and QK^T is an FP8 WGMMA on the staged bytes; the
// third warpgroup writes V^T in e4m3 into a ring of three buffers, and P V is an FP8 WGMMA with P
// rounded to e4m3.
// Sparse decoding (KVCache::kFp8Sparse, DeepSeek-V3.2's cache): a request is one query token, a
// page 64 of its indices; the third warpgroup gathers and dequantizes the tokens
// (fp8_producer.cuh) for consumers of another schedule (fp8_consumers.cuh), and with two
// m-blocks (or pairs of them) the CTAs of a request form a cluster that shares those pages.
//
// Every value read from the caller's integer arrays is checked before it is used as an index:
// a request whose length is outside [0, page_block_size * block_table columns] or that uses a block id outside
// the cache reads nothing past its arrays (block 0 stands in for a bad id) and gets NaN in its
// out / lse rows; the first such value goes to the error record (common/error.cuh). Bad
// scheduler metadata is skipped the same way; metadata computed for another kind of call (its
// scheduled topk, slot 5, is not this call's topk, or -1 for dense) is reported and its part
// does nothing.
#include <cute/tensor.hpp>

#include "common/error.cuh"
#include "common/pdl.cuh"
#include "common/sync.cuh"
#include "common/tma.cuh"
#include "mla/config.cuh"
#include "mla/params.cuh"
#include "mla/splitkv_epilogue.cuh"
#include "mla/splitkv_gemm.cuh"
#include "mla/splitkv_schedule.cuh"
#include "mla/splitkv_softmax.cuh"
#include "mla/splitkv_traits.cuh"
#include "mla/fp8_consumers.cuh"
#include "mla/fp8_expand.cuh"
#include "mla/fp8_producer.cuh"

namespace flashmla {

using namespace cute;

template <typename T>
__device__ __forceinline__ RequestSpan request_span(const SplitKVParams& p, int m_block, int req, int4 range) {
    if constexpr (T::kSparse) return sparse_request_span(p, req, range);
    return dense_request_span(p, m_block, req, range);
}

template <typename T>
struct SplitKVCta {
    using Element = typename T::Element;
    static constexpr int kTileElems = 64 * kTileCols;
    static constexpr uint32_t kTileBytes = kTileElems * sizeof(Element);

    using Rope = typename T::RopeElement;       // Q's tile 8 in registers (the seesaw)
    // Warpgroup 1's QK^T starts at V_R (16-bit cache: its page's tiles loaded first) or, in the
    // expander's order, at tile 8 (qk_tiles).
    static constexpr int kWg1FirstTile = T::kQkFromLastTile ? 0 : 4;
    const SplitKVParams& p;
    typename T::SharedStorage& st;
    const int wg, idx;                      // warpgroup, thread within it
    const int m_block, kv_head;
    // The m-block whose causal mask sets the pages read: sparse pairs read the same pages, the
    // later block's (the earlier one masks what its rows do not see).
    const int span_m_block;
    const uint32_t bar_q, bar_kv0, bar_kv1;
    // current request
    const int* block_table = nullptr;
    int req = 0;
    int seqlen = 0;
    int end_page = 0;
    float fp8_scale_log2 = 0.0f;            // dense FP8 cache: the softmax scale times k_scale

    __device__ __forceinline__ SplitKVCta(const SplitKVParams& params, typename T::SharedStorage& storage)
        : p(params), st(storage), wg(threadIdx.x / 128), idx(threadIdx.x % 128),
          m_block(blockIdx.x), kv_head(blockIdx.y),
          span_m_block(T::kSparse ? blockIdx.x | (cluster_size() - 1) : blockIdx.x),
          bar_q(smem_u32(&storage.bar_q)), bar_kv0(smem_u32(&storage.bar_kv[0][0])),
          bar_kv1(smem_u32(&storage.bar_kv[1][0])) {}

    __device__ __forceinline__ Element* page_buf(int buf) const { return st.kv[buf]; }

    // The seesaw's softmax scale (log2 domain): the dense FP8 cache's scale multiplies it.
    __device__ __forceinline__ float seesaw_scale_log2() const {
        return T::kCache == KVCache::kFp8 ? fp8_scale_log2 : p.scale_log2;
    }

    // Block id in column `column` of request `request`'s block-table row `table`. An id outside
    // the cache flags the request (NaN output, error record) and block 0 is loaded in its place.
    __device__ __forceinline__ int block_id(const int* table, int request, int column) const {
        const int id = table[column];
        if (static_cast<unsigned>(id) < static_cast<unsigned>(p.num_blocks)) return id;
        st.bad_request[request & 1] = 1;
        report_error(p.error, FLASHMLA_ERROR_BLOCK_ID, request, column, id, p.num_blocks);
        return 0;
    }

    // A page buffer is filled in pieces of min(page_block_size, 64) rows, 2^p.piece_shift: the
    // thread of the loading warpgroup whose piece() is below 64 >> piece_shift reads that piece's
    // block id ahead (piece_block_id) and issues its boxes (load_page_tiles). Consecutive pieces
    // go to different warps, so that small pages spread their TMA issue over all four.
    // (The 16-bit cache's loader warps: loader_piece.)
    __device__ __forceinline__ static int piece_of(int thread) { return thread / 32 + 4 * (thread % 32); }
    __device__ __forceinline__ int piece() const { return piece_of(idx); }
    __device__ __forceinline__ bool is_piece(int piece) const { return piece < (kBlockN >> p.piece_shift); }
    // The dense FP8 cache's one-token pages: every thread, to copy its warp's pieces (copy_staged_tokens).
    __device__ __forceinline__ bool loads_piece() const {
        return (T::kTokenPages && T::kProducer) || is_piece(piece());
    }

    // The cache block of piece `piece` of page `page` of request `request` (`seqlen` tokens). A
    // piece wholly past the request gets num_blocks: TMA fills a box outside the cache with zeros
    // and reads nothing (its bytes still count on the tile's barrier).
    __device__ __forceinline__ int piece_block_id(const int* table, int request, int seqlen, int page, int piece) const {
        const int token = page * kBlockN + (piece << p.piece_shift);
        if constexpr (T::kTokenPages && T::kProducer) {
            if (!is_piece(piece)) return p.num_blocks;                // a lane that only copies
        }
        if (token >= seqlen) return p.num_blocks;
        return block_id(table, request, token >> p.page_shift);
    }
    __device__ __forceinline__ int piece_block_id(const int* table, int request, int seqlen, int page) const {
        return piece_block_id(table, request, seqlen, page, piece());
    }
    // Warpgroup 1's P: Q's tile 8 (16-bit P; that tile of Q is kept in registers), or an e4m3 P
    // after warpgroup 0's in p0 (an e4m3 Q's buffer holds a V^T buffer there).
    __device__ __forceinline__ Element* p1_buf() const {
        if constexpr (T::kE4m3Q) return reinterpret_cast<Element*>(reinterpret_cast<uint8_t*>(st.p0) + kE4m3PBytes);
        return st.q + (kTilesK - 1) * kTileElems;
    }

    // FP8 caches: Q, loaded as bf16, becomes fp16 in place (one pass per request); the sparse
    // cache's RoPE tile stays bf16. (An e4m3 q stays as staged.)
    __device__ __forceinline__ void q_to_fp16() const {
        uint4* chunks = reinterpret_cast<uint4*>(st.q);
        constexpr int kChunks = (T::kSparse ? kTilesV : kTilesK) * kTileElems * 2 / 16;
        for (int c = threadIdx.x; c < kChunks; c += T::kConsumerThreads) {
            uint4 v = chunks[c];
            uint32_t* w = reinterpret_cast<uint32_t*>(&v);
            CUTE_UNROLL
            for (int i = 0; i < 4; ++i) w[i] = bf16x2_to_fp16x2(w[i]);
            chunks[c] = v;
        }
        fence_smem_for_async_proxy();
        consumer_sync<T>();
    }

    // Issued by one thread: all of Q for `req` (9 tiles) on bar_q. (An e4m3 q: its bytes as
    // staged boxes, fp8_staged.cuh.)
    __device__ __forceinline__ void load_q(int req) const {
        if constexpr (T::kE4m3Q) {
            mbarrier_arrive_expect_tx(bar_q, kStagedPageBytes);
            CUTE_UNROLL
            for (int box = 0; box < kStagedBoxes; ++box) {
                tma_load_4d(&p.tma_q, bar_q, smem_u32(st.q) + box * kStagedBoxBytes, box * kFp8StagedRowBytes,
                            m_block * kBlockM, kv_head, req, L2Hint::kEvictFirst);
            }
            return;
        }
        mbarrier_arrive_expect_tx(bar_q, kTilesK * kTileBytes);
        CUTE_UNROLL
        for (int t = 0; t < kTilesK; ++t) {
            tma_load_4d(&p.tma_q, bar_q, smem_u32(st.q + t * kTileElems), t * kTileCols,
                        m_block * kBlockM, kv_head, req, L2Hint::kEvictFirst);
        }
    }

    // A page feeds this CTA alone (a single m-block: h_q * s_q / h_kv <= 64): the loads, not the
    // tensor cores, bound the kernel, and refills go out as soon as a buffer is free.
    __device__ __forceinline__ bool loads_bound() const { return gridDim.x == 1; }

    // Issued by each thread that loads a piece: tiles [kFirst, kLast) of its piece of page `page`
    // (cache block `block`) into kv[buf]. Whoever consumes a tile announces the whole tile's
    // bytes on its barrier (qk_tiles).
    // Dense FP8 cache: kFirst 0 stages all the piece's e4m3 bytes (fp8_expand.cuh: their boxes
    // lie where tiles 0-3 and 8 are, free by then); tiles 4-8 need nothing more. The first
    // piece's thread announces the page's bytes, so the page is in when they are, however far
    // behind the expander is (it held an e4m3 q's QK^T back by a transposed page).
    template <int kFirst, int kLast>
    __device__ __forceinline__ void load_page_tiles(int buf, int page, int block, int piece) const {
        const int first_row = piece << p.piece_shift;                     // of the page buffer
        const int cache_row = (page * kBlockN + first_row) & (p.page_block_size - 1);
        if constexpr (T::kCache == KVCache::kFp8) {
            if constexpr (kFirst == 0) {
                const uint32_t bar = smem_u32(&st.bar_staged[buf]);
                const uint32_t dst = smem_u32(page_buf(buf)) + first_row * kFp8StagedRowBytes;
                if (first_row == 0) mbarrier_arrive_expect_tx(bar, kStagedPageBytes);
                if constexpr (T::kTokenPages) {
                    copy_staged_tokens(bar, buf, block, idx);
                    return;
                }
                CUTE_UNROLL
                for (int box = 0; box < kStagedBoxes; ++box) {
                    tma_load_4d(&p.tma_kv, bar, dst + staged_box_offset(box), box * kFp8StagedRowBytes, cache_row,
                                kv_head, block, L2Hint::kEvictFirst);
                }
            }
            return;
        }
        if constexpr (T::kTokenPages) {
            load_token_tiles<kFirst, kLast>(buf, block, piece);
            return;
        }
        const uint32_t bar = buf ? bar_kv1 : bar_kv0;
        const uint32_t dst = smem_u32(page_buf(buf) + first_row * kTileCols);
        CUTE_UNROLL
        for (int t = kFirst; t < kLast; ++t) {
            tma_load_4d(&p.tma_kv, bar + t * sizeof(uint64_t), dst + t * kTileBytes, t * kTileCols, cache_row,
                        kv_head, block, L2Hint::kEvictFirst);
        }
    }

    // The dense FP8 cache's one-token pages (T::kTokenPages), where TMA would take five boxes of
    // one row a token: every thread of the staging warpgroup enters (loads_piece), and each warp
    // copies its 16 tokens (pieces; lane k < 16 holds piece thread / 32 + 4k's `block`), eight lanes
    // to a token's row of each box and four tokens per instruction (cp.async, 16 bytes a copy;
    // copies of whole rows by each piece's thread, 16 tokens per instruction, were 6 % slower than
    // TMA: docs/perf-notes.md section 41), into the staged boxes of kv[buf] in their 128-byte
    // swizzle as TMA stores them. Box 4's bytes past the 576-byte row are zeros, as TMA's fill, and
    // so are a token's past the request (block num_blocks). Each lane then accounts for its bytes
    // on `bar` and arrives there once its copies have landed (the barrier counts these 128
    // arrivals: kernel prologue). `thread`: within the warpgroup (idx, or for the expander read
    // afresh).
    __device__ __forceinline__ void copy_staged_tokens(uint32_t bar, int buf, int block, int thread) const {
        const int lane = thread % 32, chunk = lane % 8;
        const uint32_t page = smem_u32(page_buf(buf));
        const uint8_t* head = p.cache + kv_head * p.cache_head_stride + chunk * 16;
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
            const int source = lane / 8 + 4 * j;
            const int id = __shfl_sync(0xffffffffu, block, source), row = thread / 32 + 4 * source;
            const bool inside = id < p.num_blocks;
            const uint8_t* src = head + (inside ? id : 0) * p.cache_block_stride;
            copy_staged_chunks(src, inside, chunk,
                               [&](int box) { return swizzled_chunk(page + staged_box_offset(box), row, chunk); });
        }
        mbarrier_complete_tx(bar, 4 * kStagedBoxes * 16);
        cp_async_arrive_noinc(bar);
    }

    // T::kExpanderStages (one-token pages, bf16 q): the expander stages page `page`, the `nth` of
    // its request, itself, before expanding it: into buffer nth % 2 once warpgroup 0 announces that
    // its region is free (refill: V_L and QK^T of the page two back done; the caller waits for a
    // request's first two pages, wait_next_request). Where the consumers staged these pages, the
    // copies inlined at each of their refill points spilled (docs/perf-notes.md section 41).
    __device__ __forceinline__ void stage_for_expander(const int* table, int request, int seqlen, int page, int nth,
                                                       uint32_t& refill_phases) const {
        const int buf = nth & 1;
        // The thread index read afresh, as everywhere in the expander's page loop (idx spilled).
        const int thread = thread_index_here() % 128;
        const int block = piece_block_id(table, request, seqlen, page, piece_of(thread));   // read before the wait
        if (nth >= 2) wait_refill(buf ? LoaderRefill::kV1Left : LoaderRefill::kV0Left, refill_phases);
        const uint32_t bar = smem_u32(&st.bar_staged[buf]);
        if (thread == 0) mbarrier_arrive_expect_tx(bar, kStagedPageBytes);
        copy_staged_tokens(bar, buf, block, thread);
        if (thread < 32) prefetch_token_page_ids(table, page + 2, seqlen, thread);
        prefetch_token_page(table, seqlen, page + 1, thread);
    }

    // One-token pages of the dense FP8 cache: the rows of page `page`'s tokens fetched into L2 (the
    // five 128-byte lines of a 576-byte row, threads t and t + 64 for token t % 64), where the expander's
    // copies of that page, a page later, find them; issued while this page's copies land, which
    // the expander waits for next. Its block ids are in L2 already (prefetch_token_page_ids). A bad
    // id fetches nothing (it is flagged when the page is staged).
    __device__ __forceinline__ void prefetch_token_page(const int* table, int seqlen, int page, int thread) const {
        const int token = page * kBlockN + thread % kBlockN;
        if (token >= seqlen) return;
        const int id = table[token];
        if (static_cast<unsigned>(id) >= static_cast<unsigned>(p.num_blocks)) return;
        const uint8_t* row = p.cache + kv_head * p.cache_head_stride + id * p.cache_block_stride;
        for (int line = thread / kBlockN; line * 128 < kHeadDimK; line += 2) prefetch_l2(row + 128 * line);   // a byte an element
    }

    // The 16-bit cache's one-token pages (T::kTokenPages), where TMA would take one
    // 128-byte box per token and tile (with boxes that small, page 1 took 2.3-2.7 times page 64's
    // time: docs/perf-notes.md section 38): tiles [kFirst, kLast) of the warp's 32 tokens
    // (pieces; lane k's `block` and `piece` are token k's, loader_piece) into kv[buf], 16 bytes a
    // copy (cp.async), eight lanes to a token's 128-byte row so that each copy instruction reads
    // four whole rows, stored in the tiles' 128-byte swizzle as TMA stores them. A token past the
    // request (block num_blocks) reads nothing and gets zeros. Each lane then accounts for its
    // bytes on each tile's barrier (complete_tx: the consumers' expect_tx stands as for TMA) and
    // arrives there once its copies have landed (the barrier counts these kBlockN arrivals:
    // kernel prologue).
    template <int kFirst, int kLast>
    __device__ __forceinline__ void load_token_tiles(int buf, int block, int piece) const {
        constexpr int kRowBytes = kTileCols * sizeof(Element);     // 128: one swizzle span
        const int lane = idx % 32, chunk = lane % 8;                 // chunk: 16 of the row's bytes
        const uint32_t bar = buf ? bar_kv1 : bar_kv0;
        const uint32_t tiles = smem_u32(page_buf(buf));
        CUTE_UNROLL
        for (int j = 0; j < 8; ++j) {
            const int source = lane / 8 + 4 * j;
            const int id = __shfl_sync(0xffffffffu, block, source), row = __shfl_sync(0xffffffffu, piece, source);
            const bool inside = id < p.num_blocks;
            const uint8_t* src = p.cache + (inside ? id : 0) * p.cache_block_stride + kv_head * p.cache_head_stride +
                                 chunk * 16;
            const uint32_t dst = swizzled_chunk(tiles, row, chunk);
            CUTE_UNROLL
            for (int t = kFirst; t < kLast; ++t) cp_async_16(dst + t * kTileBytes, src + t * kRowBytes, inside ? 16 : 0);
        }
        CUTE_UNROLL
        for (int t = kFirst; t < kLast; ++t) {
            mbarrier_complete_tx(bar + t * sizeof(uint64_t), kRowBytes);   // 8 copies of 16 bytes
            cp_async_arrive_noinc(bar + t * sizeof(uint64_t));
        }
    }

    // Issued for piece `piece` when request `req` may start loading: its first page into kv[0]
    // and the second into kv[1] (tiles 4-8 first: warpgroup 1 consumes them first).
    __device__ __forceinline__ void load_first_pages(int req, const RequestSpan& r, int piece) const {
        if (r.first_page >= r.end_page) return;
        const int* table = p.block_table + req * p.block_table_stride;
        load_page_tiles<0, kTilesK>(0, r.first_page, piece_block_id(table, req, r.seqlen, r.first_page, piece), piece);
        if (r.first_page + 1 < r.end_page) {
            const int next = piece_block_id(table, req, r.seqlen, r.first_page + 1, piece);
            load_page_tiles<4, kTilesK>(1, r.first_page + 1, next, piece);
            load_page_tiles<0, 4>(1, r.first_page + 1, next, piece);
        }
    }

    // Tiles [kFirst, kLast) of page buffer `buf` are free here (the WGMMAs that read them are
    // done): the 16-bit cache's loader warps (or the expander, T::kExpanderStages) refill them
    // with page `page` once this warpgroup's first thread announces it (`which`); otherwise the
    // FP8 cache's consumers stage the page themselves (`block`: their piece's cache block).
    template <int kFirst, int kLast>
    __device__ __forceinline__ void refill(LoaderRefill which, int buf, int page, int block) const {
        if constexpr (!T::kConsumersLoad) {
            if (idx == 0) mbarrier_arrive(smem_u32(&st.bar_refill[int(which)]));
        } else if (loads_piece()) {
            load_page_tiles<kFirst, kLast>(buf, page, block, piece());
        }
    }

    // V_R of page buffer `buf` is consumed (warpgroup 1): tiles 4-8 of `page` follow (16-bit
    // cache), or the expander may go on (dense FP8 cache: one arrival per warp).
    __device__ __forceinline__ void refill_v_right(int buf, int page, int block) const {
        if constexpr (T::kCache == KVCache::kFp8) {
            if (idx % 32 == 0) mbarrier_arrive(smem_u32(&st.bar_free[buf]));
        } else {
            refill<4, kTilesK>(buf ? LoaderRefill::kV1Right : LoaderRefill::kV0Right, buf, page, block);
        }
    }

    // The loader warps' piece: warps r and r + 2 share the role-r refills (run_loads); lane k of
    // the first takes piece 2k, of the second 2k + 1, so the 64 pieces of one-token pages are one a lane.
    __device__ __forceinline__ int loader_piece() const { return idx / 64 + 2 * (idx % 32); }

    // Where the third warpgroup loads (T::kLoaderWarps, T::kExpanderStages): the consumers have
    // announced refill `which` (bit i of `phases`: bar_refill[i]'s phase).
    __device__ __forceinline__ void wait_refill(LoaderRefill which, uint32_t& phases) const {
        const int i = int(which);
        mbarrier_wait(smem_u32(&st.bar_refill[i]), (phases >> i) & 1);
        phases ^= 1u << i;
    }

    // ... and Q and the page buffers are free for request `req`: the consumers are past the
    // request before.
    __device__ __forceinline__ void wait_next_request(int req, int begin_req) const {
        if (req > begin_req) mbarrier_wait(smem_u32(&st.bar_next_request), (req - begin_req - 1) & 1);
    }

    // The 16-bit cache's loads, issued by the third warpgroup, so that the consumers' warps never
    // spend their time on TMA issue: warps 0 and 2 load Q (warp 0), each request's first pages and
    // the refills warpgroup 0 announces (V0_L, V1_L), warps 1 and 3 those of warpgroup 1 (V1_R,
    // V0_R), each in its warpgroup's order; a lane loads one piece (loader_piece). Block ids are
    // read before each wait, so that their latency overlaps it.
    // Where a page is one piece (page_block_size >= 64), warps 2 and 3 load nothing and wait for
    // no refill: the consumers' next announcement waits for the loads of the warps that issue
    // them, not for these, which could fall two phases behind a refill barrier and wait for ever
    // (a hang in 2 of 25 bf16 profiles: docs/perf-notes.md section 48).
    __device__ __forceinline__ void run_loads(int begin_req, const SchedRow& row) const {
        const int role = (idx / 32) % 2, lane = idx % 32;
        const int piece = loader_piece();
        const bool loads = is_piece(piece);
        const bool warp_loads = is_piece(idx / 64);      // its lane 0's piece, the warp's first
        uint32_t refill_phases = 0;                      // bit i: bar_refill[i]'s
        #pragma unroll 1
        for (int req = begin_req; req <= row.end_req; ++req) {
            const RequestSpan span = request_span<T>(p, m_block, req, row.range);
            const int* table = p.block_table + req * p.block_table_stride;
            wait_next_request(req, begin_req);
            if (role == 0) {
                if (idx == 0) load_q(req);
                if (loads) load_first_pages(req, span, piece);
            }
            #pragma unroll 1
            for (int page = span.first_page; warp_loads && page + 2 < span.end_page; page += 2) {
                const bool pair_follows = page + 3 < span.end_page;
                const int id2 = loads ? piece_block_id(table, req, span.seqlen, page + 2, piece) : 0;
                const int id3 = loads && pair_follows ? piece_block_id(table, req, span.seqlen, page + 3, piece) : 0;
                if (role == 0) {
                    wait_refill(LoaderRefill::kV0Left, refill_phases);
                    if (loads) load_page_tiles<0, 4>(0, page + 2, id2, piece);
                    if (pair_follows) {
                        wait_refill(LoaderRefill::kV1Left, refill_phases);
                        if (loads) load_page_tiles<0, 4>(1, page + 3, id3, piece);
                    }
                } else {
                    if (pair_follows) {
                        wait_refill(LoaderRefill::kV1Right, refill_phases);
                        if (loads) load_page_tiles<4, kTilesK>(1, page + 3, id3, piece);
                    }
                    wait_refill(LoaderRefill::kV0Right, refill_phases);
                    if (loads) load_page_tiles<4, kTilesK>(0, page + 2, id2, piece);
                }
            }
            // The bad-id flags of this request are set (block_id, by any lane): the consumers may
            // read them.
            __syncwarp();
            if (lane == 0) mbarrier_arrive(smem_u32(&st.bar_loads_issued));
        }
    }

    // An e4m3 q: the V^T buffers of the page pair (page, page + 1), `vt` and the next in the ring
    // (fp8_staged.cuh); elsewhere V is read from the page buffers themselves.
    __device__ __forceinline__ int next_transposed_v(int vt) const { return vt == kTransposedVBuffers - 1 ? 0 : vt + 1; }
    __device__ __forceinline__ Element* v_source(int buf, int vt) const {
        return T::kE4m3Q ? transposed_v_buffer<T>(st, vt) : page_buf(buf);
    }

    // An e4m3 q: P V waits for the expander's half `kHalf` of V^T buffer `vt` (its barrier:
    // bar_kv[0][2 vt + kHalf]); bit v of `v_phases` is buffer v's phase (each warpgroup reads
    // half of every page's V).
    template <int kHalf>
    __device__ __forceinline__ void wait_expanded(int vt, uint32_t& v_phases) const {
        if constexpr (T::kE4m3Q) {
            mbarrier_wait(bar_kv0 + (2 * vt + kHalf) * sizeof(uint64_t), (v_phases >> vt) & 1);
            v_phases ^= 1u << vt;
        }
    }

    // An e4m3 q: the page after next, `page`, staged into kv[buf] as soon as the page there is
    // done with its staged bytes: its QK^T (this warpgroup's, complete) and the expander's reads
    // (both halves of its V^T, buffer `vt`, written; called after this warpgroup's wait_expanded
    // of that page, hence the phase before it). Issued with this warpgroup's first P V of the
    // page, while the other warpgroup works, where the 16-bit cache refills only after its second.
    __device__ __forceinline__ void stage_page_after_next(int buf, int page, int block, int vt, uint32_t v_phases) const {
        if (!loads_piece()) return;
        const uint32_t bar = bar_kv0 + 2 * vt * sizeof(uint64_t);
        const uint32_t phase = ((v_phases >> vt) & 1) ^ 1;
        mbarrier_wait(bar, phase);
        mbarrier_wait(bar + sizeof(uint64_t), phase);
        load_page_tiles<0, 4>(buf, page, block, piece());
    }

    // An e4m3 q: this warpgroup's P V is done with its half of V^T buffer `vt`, whose page is
    // followed by three more of the request (the expander reuses the buffer three pages on). One
    // arrival per warp on bar_free[vt], eight in all.
    __device__ __forceinline__ void release_transposed_v(int vt, int page) const {
        if (T::kE4m3Q && page + kTransposedVBuffers < end_page && idx % 32 == 0) {
            mbarrier_arrive(smem_u32(&st.bar_free[vt]));
        }
    }

    // Zero the V half `kHalf` of tokens >= `valid` in a page buffer: their cache slots may hold
    // anything (NaN), and 0 * NaN would leak into O although their P is 0. A swizzled row stays
    // within its own 128 bytes, so whole rows of each tile are cleared. (The dense FP8 cache's
    // expander writes those rows as zeros.)
    template <int kHalf>
    __device__ __forceinline__ void zero_invalid_v_rows(Element* page, int valid) const {
        if constexpr (!T::kProducer) {
            valid = max(valid, 0);
            constexpr int kChunksPerRow = 4 * 8;          // 4 tiles x 8 chunks of 16 bytes
            for (int i = idx; i < (kBlockN - valid) * kChunksPerRow; i += 128) {
                const int row = valid + i / kChunksPerRow;
                const int tile = kHalf * 4 + (i / 8) % 4;
                reinterpret_cast<uint4*>(page + tile * kTileElems + row * kTileCols)[i % 8] = make_uint4(0, 0, 0, 0);
            }
            fence_smem_for_async_proxy();
            named_barrier_sync(6 + wg, 128);
        }
    }

    // Warpgroup 0 on the page pair (page, page + 1). kLast0: `page` is the last page;
    // kLast1: page + 1 is. On entry s holds S0 = Q K0^T; on exit, that of page + 2.
    // `vt`: an e4m3 q's V^T buffer of `page`; advanced to that of page + 2.
    template <bool kLast0, bool kLast1, typename FragS, typename FragO, typename FragQ8>
    __device__ __forceinline__ void wg0_step(int page, FragS& s, FragO& o, FragQ8 const& q8, RowState& rows,
                             uint32_t& phase0, uint32_t& v_phases, int& vt) const {
        Element* k0 = page_buf(0);
        Element* k1 = page_buf(1);
        const int vt1 = next_transposed_v(vt);
        Element* v0 = v_source(0, vt);
        Element* v1 = v_source(1, vt1);
        const int first_token = page * kBlockN;
        Tensor pb = make_tensor<typename T::PElement>(typename T::LayoutFragP{});
        // Block ids of the next pair, read now: their load latency overlaps the softmax and GEMMs
        // instead of delaying the TMA requests that need them (the 16-bit cache's loader warps,
        // and the expander where it stages, read their own).
        int next_id0 = 0, next_id1 = 0;
        if constexpr (!kLast0 && !kLast1 && T::kConsumersLoad) {
            if (loads_piece()) {
                next_id0 = piece_block_id(block_table, req, seqlen, page + 2);
                if (!T::kE4m3Q && page + 3 < end_page) next_id1 = piece_block_id(block_table, req, seqlen, page + 3);
            }
        }

        wg0_softmax<kLast0 || kLast1>(s, pb, o, rows, st.row_max, st.scale0, seesaw_scale_log2(), first_token, idx);
        named_barrier_arrive(int(WgBarrier::kScale0Ready), 256);
        wait_expanded<0>(vt, v_phases);
        if constexpr (kLast0) zero_invalid_v_rows<0>(k0, seqlen - first_token);
        pv_reg_p<T, 0>(pb, v0, o, idx);                         // O_L += P0 V0_L
        if constexpr (T::kE4m3Q && !kLast0 && !kLast1) stage_page_after_next(0, page + 2, next_id0, vt, v_phases);
        warpgroup_wait<0>();
        if constexpr (!kLast0 && !kLast1) release_transposed_v(vt, page);

        // V0_L consumed: page + 2's tiles 0-3 (the FP8 cache: its whole page, staged where tiles
        // 0-3 and 8 are, free too). Where loads bound the kernel, at once; otherwise once
        // warpgroup 1 has page + 1's scale (FlashMLA's place, faster there).
        constexpr bool kRefillV0l = !kLast0 && !kLast1 && !T::kE4m3Q;
        if (kRefillV0l && loads_bound()) refill<0, 4>(LoaderRefill::kV0Left, 0, page + 2, next_id0);
        named_barrier_sync(int(WgBarrier::kScale1Ready), 256);
        if (kRefillV0l && !loads_bound()) refill<0, 4>(LoaderRefill::kV0Left, 0, page + 2, next_id0);
        float scale1[2];
        read_scale1(st.scale1, idx, scale1);
        wg0_rescale_p(s, pb, scale1);
        store_p<T>(pb, st.p0, idx);
        fence_smem_for_async_proxy();
        named_barrier_arrive(int(WgBarrier::kP0Ready), 256);
        if constexpr (T::kE4m3Q && !kLast0 && !kLast1) {
            // S0 of page + 2, while warpgroup 1 issues its P V: P0 was rescaled from itself, so
            // S's registers are free.
            qk_staged<T, 0, kStagedBoxes, true>(st.q, k0, smem_u32(&st.bar_staged[0]), phase0, s, idx);
            phase0 ^= 1;
        }

        if constexpr (!kLast0) {
            wait_expanded<0>(vt1, v_phases);
            if constexpr (kLast1) zero_invalid_v_rows<0>(k1, seqlen - first_token - kBlockN);
            named_barrier_sync(int(WgBarrier::kP1Issued), 256);
            wg0_rescale_o(o, rows, scale1);
            pv_smem_p<T, 0>(p1_buf(), v1, o, idx);              // O_L += P1 V1_L
        }
        if constexpr (!kLast0 && !kLast1 && !T::kE4m3Q) {
            // V1_L is refilled once P1 V1_L is done (page + 3's tiles 0-3). Where loads bound the
            // kernel, before S0 of page + 2 waits for that page's tiles, still in flight; otherwise
            // after S0's first tiles are issued (refilling first was 1-6 % slower there).
            const bool refill_v1l = page + 3 < end_page;
            if (refill_v1l && loads_bound()) {
                warpgroup_wait<0>();                             // P1 V1_L done: V1_L free
                refill<0, 4>(LoaderRefill::kV1Left, 1, page + 3, next_id1);
            }
            // S0 of page + 2: its tiles 0-3 were requested first, so start with them (FP8: 8-5).
            qk_tiles<T, 0, 4, true>(st.q, k0, bar_kv0, phase0, q8, s, idx);
            if (refill_v1l && !loads_bound()) {
                warpgroup_wait<4>();                             // P1 V1_L done: V1_L free
                refill<0, 4>(LoaderRefill::kV1Left, 1, page + 3, next_id1);
            }
            qk_tiles<T, 4, kTilesK - 4, false>(st.q, k0, bar_kv0, phase0, q8, s, idx);
            phase0 ^= 1;
        }
        warpgroup_wait<0>();
        if constexpr (!kLast0 && !kLast1) release_transposed_v(vt1, page + 1);   // P1 V1_L done
        vt = next_transposed_v(vt1);
    }

    // Warpgroup 1 on the page pair (page, page + 1); kLast2: page + 2 is the last page.
    // On entry s holds S1 = Q K1^T (unless kLast0); on exit, that of page + 3.
    template <bool kLast0, bool kLast1, bool kLast2, typename FragS, typename FragO, typename FragQ8>
    __device__ __forceinline__ void wg1_step(int page, FragS& s, FragO& o, FragQ8 const& q8, RowState& rows,
                             uint32_t& phase1, uint32_t& v_phases, int& vt) const {
        Element* k0 = page_buf(0);
        Element* k1 = page_buf(1);
        const int vt1 = next_transposed_v(vt);
        Element* v0 = v_source(0, vt);
        Element* v1 = v_source(1, vt1);
        const int first_token = (page + 1) * kBlockN;
        Tensor pb = make_tensor<typename T::PElement>(typename T::LayoutFragP{});
        int next_id0 = 0, next_id1 = 0;                           // as in wg0_step
        if constexpr (!kLast0 && !kLast1 && T::kConsumersLoad) {
            if (loads_piece()) {
                next_id0 = piece_block_id(block_table, req, seqlen, page + 2);
                if constexpr (!kLast2) next_id1 = piece_block_id(block_table, req, seqlen, page + 3);
            }
        }

        named_barrier_sync(int(WgBarrier::kScale0Ready), 256);
        wg1_softmax<kLast0, kLast1 || kLast2>(s, pb, o, rows, st.row_max, st.scale0, st.scale1, seesaw_scale_log2(),
                                              first_token, idx);
        named_barrier_arrive(int(WgBarrier::kScale1Ready), 256);

        if constexpr (!kLast0) {
            store_p<T>(pb, p1_buf(), idx);
            wait_expanded<1>(vt1, v_phases);
            if constexpr (kLast1) zero_invalid_v_rows<1>(k1, seqlen - first_token);
            pv_reg_p<T, 1>(pb, v1, o, idx);                      // O_R += P1 V1_R
            fence_smem_for_async_proxy();                         // P1 visible to warpgroup 0's WGMMA
            if constexpr (T::kE4m3Q && !kLast1 && !kLast2) stage_page_after_next(1, page + 3, next_id1, vt1, v_phases);
        }
        named_barrier_sync(int(WgBarrier::kP0Ready), 256);
        wait_expanded<1>(vt, v_phases);
        if constexpr (kLast0) zero_invalid_v_rows<1>(k0, seqlen - first_token + kBlockN);
        pv_smem_p<T, 1>(st.p0, v0, o, idx);                       // O_R += P0 V0_R
        if constexpr (!kLast0) named_barrier_arrive(int(WgBarrier::kP1Issued), 256);

        if constexpr (!kLast0 && !kLast1 && !kLast2) {
            warpgroup_wait<1>();                                  // P1 V1_R done: V1_R free
            if constexpr (T::kE4m3Q) {
                release_transposed_v(vt1, page + 1);
            } else {
                refill_v_right(1, page + 3, next_id1);
            }
        }
        if constexpr (!kLast0 && !kLast1) {
            warpgroup_wait<0>();                                  // P0 V0_R done: V0_R free
            if constexpr (T::kE4m3Q) {
                release_transposed_v(vt, page);
            } else {
                refill_v_right(0, page + 2, next_id0);
            }
        }
        if constexpr (!kLast0 && !kLast1 && !kLast2) {
            qk_page(1, phase1, q8, s);
            phase1 ^= 1;
        }
        // Kept outside the branches above: a wait inside them makes ptxas serialize the WGMMAs.
        warpgroup_wait<0>();
        vt = next_transposed_v(vt1);
    }

    // S = Q K^T of the whole page in kv[buf] (warpgroup 1's order), issued as its tiles arrive
    // (an e4m3 q: once its bytes are staged).
    template <typename FragQ8, typename FragS>
    __device__ __forceinline__ void qk_page(int buf, uint32_t phase, FragQ8 const& q8, FragS& s) const {
        if constexpr (T::kE4m3Q) {
            qk_staged<T, 0, kStagedBoxes, true>(st.q, page_buf(buf), smem_u32(&st.bar_staged[buf]), phase, s, idx);
        } else {
            qk_tiles<T, kWg1FirstTile, kTilesK, true>(st.q, page_buf(buf), buf ? bar_kv1 : bar_kv0, phase, q8, s, idx);
        }
    }

    // Q's tile 8 for qk_tiles: in registers (p1_buf is warpgroup 1's P), or, for an e4m3 q, not
    // used (Q stays staged in sQ).
    __device__ __forceinline__ auto rope_tile_of_q() const {
        if constexpr (T::kE4m3Q) {
            return RopeTileInSmem{};
        } else {
            Tensor q8 = make_tensor<Rope>(typename T::LayoutFragA{});
            load_a_tile<T, Rope>(reinterpret_cast<Rope*>(p1_buf()), q8, idx);
            return q8;
        }
    }

    // Pages [first_page, end_page) of the current request; O and the row sums accumulate.
    template <typename FragO>
    __device__ __forceinline__ void mainloop(int first_page, FragO& o, RowState& rows, uint32_t& phase0,
                             uint32_t& phase1, uint32_t& v_phases) const {
        const auto q8 = rope_tile_of_q();
        Tensor s = partition_fragment_C(typename T::MmaQK{}, Shape<Int<kBlockM>, Int<kBlockN>>{});
        int page = first_page;
        int vt = 0;                             // an e4m3 q: the V^T buffer of `page` (the expander's ring)
        if ((T::kProducer ? thread_index_here() / 128 : wg) == 0) {   // FP8: read afresh, as the epilogue's
            if constexpr (T::kE4m3Q) {
                qk_page(0, phase0, q8, s);
            } else {
                qk_full_page<T>(st.q, page_buf(0), bar_kv0, phase0, s, idx);
            }
            phase0 ^= 1;
            named_barrier_sync(int(WgBarrier::kRowMaxInit), 128);
            warpgroup_wait<0>();
            #pragma unroll 1
            for (; page < end_page - 2; page += 2) wg0_step<false, false>(page, s, o, q8, rows, phase0, v_phases, vt);
            if (page + 1 < end_page) {
                wg0_step<false, true>(page, s, o, q8, rows, phase0, v_phases, vt);
            } else if (page < end_page) {
                wg0_step<true, false>(page, s, o, q8, rows, phase0, v_phases, vt);
            }
        } else {
            if (page + 1 < end_page) {
                qk_page(1, phase1, q8, s);
                phase1 ^= 1;
                warpgroup_wait<0>();
            }
            #pragma unroll 1
            for (; page < end_page - 3; page += 2) wg1_step<false, false, false>(page, s, o, q8, rows, phase1, v_phases, vt);
            if (page + 2 < end_page) {
                wg1_step<false, false, true>(page, s, o, q8, rows, phase1, v_phases, vt);
                wg1_step<true, false, false>(page + 2, s, o, q8, rows, phase1, v_phases, vt);
            } else if (page + 1 < end_page) {
                wg1_step<false, true, false>(page, s, o, q8, rows, phase1, v_phases, vt);
            } else if (page < end_page) {
                wg1_step<true, false, false>(page, s, o, q8, rows, phase1, v_phases, vt);
            }
        }
    }

    // The part's schedule where it is used. The dense FP8 cache reads it again at each use: its
    // consumers have no register to keep it across the page loop (the e4m3 q's kernel spilled it,
    // 24 B); the other kernels keep the prologue's (sparse: 8 B of spills if read again).
    __device__ __forceinline__ SchedRow schedule(const SchedRow& kept) const {
        if constexpr (T::kCache == KVCache::kFp8) {
            return sched_row_here(p);
        } else {
            return kept;
        }
    }

    // Sparse: each row's attention sink into st.sink_log2, once: a request is one query token, so
    // the m-block's heads are the same in every request. Loaded where the epilogue wants it, its
    // latency behind the producer's gathers cost each request ~2 µs (docs/perf-notes.md section 52).
    // By the values warpgroup, idle until the first P; read after reduce_row_sums' barrier.
    __device__ __forceinline__ void load_sinks() const {
        if (idx >= kBlockM) return;
        const int head = m_block * kBlockM + idx;
        const bool present = p.attn_sink != nullptr && idx < p.q_rows - m_block * kBlockM;
        st.sink_log2[idx] = present ? p.attn_sink[head] * kLog2e : -kInf;
    }

    // The scheduler's requests [begin_req, end_req] (`row`: its metadata), from the first Q load
    // to the last output. kRole: the sparse warpgroup (0 scores, 1 values), each compiled apart
    // so that ptxas keeps it within its own register budget; -1: dense.
    template <int kRole>
    __device__ __forceinline__ void run_requests(int begin_req, const SchedRow& row) {
        uint32_t phase0 = 0, phase1 = 0;                 // dense: TMA phases of the page buffers
        uint32_t v_phases = 0;                           // an e4m3 q: wait_expanded
        uint32_t kv_phase = 0;                           // FP8: bit b, the phase of page buffer b
        if constexpr (T::kSparse && kRole == 1) load_sinks();
        // Which bad_request flag is this request's: the loads run one request ahead (req & 1).
        // (Sparse requests are never bad.)
        if constexpr (!T::kLoaderWarps) {
            if (threadIdx.x == 0) load_q(begin_req);
            if constexpr (T::kSeesaw && T::kConsumersLoad) {
                if (wg == 0 && loads_piece()) {
                    load_first_pages(begin_req, request_span<T>(p, m_block, begin_req, schedule(row).range), piece());
                }
            }
        }
        // The FP8 caches' scale multiplies the scores (here) and O (output_factors); an e4m3 q's, the scores.
        float scale_log2 = p.scale_log2;
        if constexpr (T::kCache == KVCache::kFp8) scale_log2 *= *p.kv_scale;
        if constexpr (T::kE4m3Q) scale_log2 *= *p.q_scale;
        fp8_scale_log2 = scale_log2;

        #pragma unroll 1
        for (int req = begin_req; req <= schedule(row).end_req; ++req) {
            const RequestSpan span = request_span<T>(p, span_m_block, req, schedule(row).range);
            RowState rows;
            rows.sum[0] = rows.sum[1] = 0.0f;
            CUTE_UNROLL
            for (int half = 0; half < 2; ++half) {
                const int row = fragment_row(half, idx);
                rows.right_border[half] = p.causal ? min(span.seqlen - causal_mask_len(p, m_block, row),
                                                         span.end_page * kBlockN)
                                                   : span.seqlen;
            }
            if (span.bad && threadIdx.x == 0) {
                report_error(p.error, FLASHMLA_ERROR_SEQLEN_RANGE, req, p.page_block_size, p.seqlens[req],
                             p.max_blocks_per_seq);
            }
            block_table = p.block_table + req * p.block_table_stride;
            this->req = req;
            seqlen = span.seqlen;
            end_page = span.end_page;

            Tensor o = partition_fragment_C(typename T::MmaPVRegP{}, Shape<Int<kBlockM>, Int<kHeadDimV / 2>>{});
            clear(o);
            if (T::kSeesaw && threadIdx.x < kBlockM) st.row_max[threadIdx.x] = kRowMaxInit;

            // Sparse: a split request's first split index, for the epilogue, loaded by the values
            // warpgroup while Q arrives (a load behind the producer's gathers waits ~2 µs).
            int split_base = 0;
            if (T::kSparse && kRole == 1 && idx == 0 && !span.whole) split_base = p.num_splits[req];
            mbarrier_wait(bar_q, (req - begin_req) & 1);   // Q's phase from the count: one register less
            if constexpr (T::kProducer && !T::kE4m3Q) q_to_fp16();
            if (T::kSparse && kRole == 1 && idx == 0) st.split_base[req & 1] = split_base;
            if constexpr (T::kSparse) {
                if constexpr (kRole == 0) {
                    float row_max[2] = {kRowMaxInit, kRowMaxInit};
                    fp8_scores_pages<T>(st, scale_log2, span.first_page, span.end_page, o, rows, row_max, kv_phase,
                                        idx);
                    if (idx % 4 == 0) {
                        st.row_max[fragment_row(0, idx)] = row_max[0];
                        st.row_max[fragment_row(1, idx)] = row_max[1];
                    }
                } else {
                    fp8_values_pages<T>(st, span.first_page, span.end_page, o, idx);
                }
            } else if (span.first_page < span.end_page) {
                mainloop(span.first_page, o, rows, phase0, phase1, v_phases);
            }

            // FP8 caches: the epilogue's coordinates read afresh (thread_index_here); the 16-bit
            // kernel has the registers, and its timed schedule stays as it is.
            int epilogue_wg = wg, epilogue_idx = idx;
            if constexpr (T::kProducer) {
                const int tid = thread_index_here();
                epilogue_wg = tid / 128;
                epilogue_idx = tid % 128;
            }
            // The loader warps have set this request's bad-id flags and are past its loads. Every
            // consumer warp waits before reduce_row_sums' barrier, so that the arrival on
            // bar_next_request below comes after all of them: else the loaders could finish the
            // next request (one without pages to wait for) and complete this barrier's next phase
            // too, and a warp still to wait would find the parity of the phase after and hang
            // (seen under compute-sanitizer, docs/perf-notes.md section 47).
            if constexpr (T::kLoaderWarps) mbarrier_wait(smem_u32(&st.bar_loads_issued), (req - begin_req) & 1);
            float sums[2];
            reduce_row_sums<T>(rows, st, epilogue_wg, epilogue_idx, sums);   // all warps are past the mainloop
            if (req < schedule(row).end_req) {
                // Q and page buffers are free: the next request loads while this one is written out.
                if constexpr (T::kLoaderWarps) {
                    if (threadIdx.x == 0) mbarrier_arrive(smem_u32(&st.bar_next_request));
                } else {
                    if (threadIdx.x == 0) load_q(req + 1);
                    if constexpr (T::kExpanderStages) {
                        if (threadIdx.x == 0) mbarrier_arrive(smem_u32(&st.bar_next_request));
                    } else if constexpr (T::kSeesaw) {
                        if (wg == 0 && loads_piece()) {
                            load_first_pages(req + 1, request_span<T>(p, m_block, req + 1, schedule(row).range), piece());
                        }
                    }
                }
            } else {
                pdl_allow_dependents();                             // the combine kernel may start
            }
            OutputTarget out;
            out.batch_idx = req;
            out.kv_head = kv_head;
            out.m_block = m_block;
            out.num_rows = min(p.q_rows - m_block * kBlockM, kBlockM);
            const long long split = (long long)(T::kSparse ? st.split_base[req & 1] : p.num_splits[req]) +
                                    (req == begin_req ? schedule(row).begin_split : 0);
            out.split_idx = span.whole ? -1 : static_cast<int>(split);
            const int bad_slot = req & 1;
            // Flags set before reduce_row_sums' barrier, by the loader warps before bar_loads_issued,
            // by the expander (T::kExpanderStages) before its arrivals on the pages' tiles.
            out.bad = span.bad || st.bad_request[bad_slot];
            if (!span.whole && (split < 0 || split >= p.total_splits)) {
                if (threadIdx.x == 0) report_error(p.error, FLASHMLA_ERROR_SCHEDULE, req, 0, static_cast<int>(split), p.total_splits);
                out.num_rows = 0;                                   // nowhere valid to write
            }
            // A zero sum means no visible token (or overflow): O = 0, lse = +inf, as FlashMLA.
            float inv_sum[2];
            output_factors<T>(p, st, out, sums, epilogue_idx, inv_sum);
            store_o<T, kRole>(p, o, inv_sum, out, epilogue_wg, epilogue_idx);
            store_lse<T>(p, st, out);
            if (req != schedule(row).end_req) {
                consumer_sync<T>();                                 // row_max, row_sum, bad_request are reused
                if (threadIdx.x == 0) st.bad_request[bad_slot] = 0;
            }
        }
    }
};

template <typename Element, KVCache kCache, bool kE4m3Q = false, bool kTokenPages = false, bool kPairs = false>
__global__ void __launch_bounds__(SplitKVTraits<Element, kCache>::kThreads, 1)
splitkv_mla_kernel(const __grid_constant__ SplitKVParams p) {
    using T = SplitKVTraits<Element, kCache, kE4m3Q, kTokenPages, kPairs>;
    constexpr bool kSparse = T::kSparse, kProducer = T::kProducer;
    extern __shared__ __align__(1024) unsigned char smem[];
    auto& st = *reinterpret_cast<typename T::SharedStorage*>(smem);
    SplitKVCta<T> cta(p, st);

    if (threadIdx.x == 0) {
        st.bad_request[0] = st.bad_request[1] = 0;
        tma_prefetch_descriptor(&p.tma_q);
        tma_prefetch_descriptor(&p.tma_kv);
        mbarrier_init(cta.bar_q, 1);
        // 16-bit cache: one arrival (the consumer announcing TMA's bytes), and at one-token pages
        // one per loading lane (load_token_tiles); FP8: one per producer warp, and on the sparse
        // RoPE tile's barrier one more per producer thread (Fp8Producer::copy_rope).
        const uint32_t fills = kProducer ? kProducerThreads / 32 : T::kTokenPages ? 1 + kBlockN : 1;
        for (int t = 0; t < kTilesK; ++t) {
            const uint32_t count = fills + (kSparse && t == T::kv_barrier(kTilesK - 1) ? kProducerThreads : 0);
            mbarrier_init(cta.bar_kv0 + t * sizeof(uint64_t), count);
            mbarrier_init(cta.bar_kv1 + t * sizeof(uint64_t), count);
        }
        // Sparse: a tile group's warpgroup in each CTA of the cluster releases it (free_barrier).
        // Dense FP8: every warp of warpgroup 1 releases V_R (refill_v_right), or with an e4m3 q
        // every warp of both warpgroups its half of a V^T buffer (release_transposed_v); one
        // arrival (the byte count of the thread staging the page's first piece), and at one-token
        // pages one per thread of the staging warpgroup (copy_staged_tokens), completes a staged page.
        for (int b = 0; b < (kSparse ? 4 : kTransposedVBuffers); ++b) {
            mbarrier_init(smem_u32(&st.bar_free[b]), kSparse ? cluster_size() : T::kE4m3Q ? 8 : 4);
        }
        for (int b = 0; b < 2; ++b) mbarrier_init(smem_u32(&st.bar_staged[b]), T::kTokenPages ? 1 + 128 : 1);
        // 16-bit (and kExpanderStages): a consumer warpgroup's first thread announces each refill
        // and the end of a request; 16-bit: each of the four loader warps, a request's loads.
        if constexpr (!T::kConsumersLoad) {
            for (auto& bar : st.bar_refill) mbarrier_init(smem_u32(&bar), 1);
            mbarrier_init(smem_u32(&st.bar_next_request), 1);
            mbarrier_init(smem_u32(&st.bar_loads_issued), 4);
        }
        mbarrier_init_fence();
    }
    // Sparse pairs write into each other's buffers and barriers: both must be initialized.
    if constexpr (kProducer) {
        cluster_sync();
    } else {
        __syncthreads();
    }

    // Everything below reads what earlier kernels wrote (scheduler metadata, inputs).
    pdl_wait_for_producers();
    const SchedRow row = sched_row(p, p.sched_meta + blockIdx.z * kSchedMetaInts);
    const int4 range = row.range;
    // Every CTA of a cluster reads the same row, so all of them return here.
    if (!part_is_runnable(p, row, kSparse ? p.topk : -1)) return;
    const int begin_req = range.x, end_req = row.end_req;

    if constexpr (kProducer) {
        if (threadIdx.x >= T::kConsumerThreads) {
            warpgroup_release_registers<T::kProducerRegs>();
            if constexpr (kSparse) {
                Fp8Producer<T> producer(p, st);
                #pragma unroll 1
                for (int req = begin_req; req <= end_req; ++req) {
                    const RequestSpan span = request_span<T>(p, cta.span_m_block, req, range);
                    const int* ids = p.indices + (req / p.sparse_s_q) * p.indices_stride_b +
                                     (req % p.sparse_s_q) * p.indices_stride_s;
                    producer.fill_pages(IndexedTokens{ids, span.seqlen}, span.first_page, span.end_page);
                }
            } else {
                Fp8Expander<T> expander(st);
                uint32_t refill_phases = 0;                 // T::kExpanderStages: stage_for_expander
                #pragma unroll 1
                for (int req = begin_req; req <= cta.schedule(row).end_req; ++req) {
                    const RequestSpan span = request_span<T>(p, cta.m_block, req, cta.schedule(row).range);
                    const int* table = p.block_table + req * p.block_table_stride;
                    if constexpr (T::kExpanderStages) cta.wait_next_request(req, begin_req);
                    #pragma unroll 1
                    for (int page = span.first_page; page < span.end_page; ++page) {
                        const int nth = page - span.first_page;
                        if constexpr (T::kExpanderStages) {
                            cta.stage_for_expander(table, req, span.seqlen, page, nth, refill_phases);
                        }
                        expander.expand_page(nth & 1, nth, span.seqlen - page * kBlockN);
                    }
                }
            }
        } else if constexpr (kSparse) {
            if (cta.wg == 0) {
                warpgroup_claim_registers<T::kScoresRegs>();
                cta.template run_requests<0>(begin_req, row);
            } else {
                warpgroup_release_registers<T::kValuesRegs>();
                cta.template run_requests<1>(begin_req, row);
            }
        } else {
            if (cta.wg == 0) {
                warpgroup_claim_registers<T::kScoresRegs>();
            } else {
                warpgroup_claim_registers<T::kValuesRegs>();
            }
            cta.template run_requests<-1>(begin_req, row);
        }
        // Neither CTA of a pair exits while the other may write into it. One call for all the
        // warpgroups: reached from two, it is two CTA barriers where no cluster is launched, which
        // compute-sanitizer's synccheck reports as divergent threads.
        cluster_sync();
    } else if (threadIdx.x >= T::kConsumerThreads) {
        warpgroup_release_registers<T::kProducerRegs>();
        cta.run_loads(begin_req, row);
    } else {
        warpgroup_claim_registers<T::kScoresRegs>();
        cta.template run_requests<-1>(begin_req, row);
    }
}

}  // namespace flashmla
