// Dense decoding over the FP8 cache with a bf16 q for at most 32 query rows per KV head
// (h_q * s_q / h_kv <= 32, the most memory-bound shapes): the "narrow" kernel.
//
// The split-KV kernel's FP8 form pads these rows to the 64 of a WGMMA and needs each page in fp16
// in shared memory, expanded by a warpgroup whose chain of conversions, stores and barriers bounds
// it (docs/perf-notes.md section 16). Here the consumer warps convert the staged e4m3 bytes
// straight into register fragments of the MMA, and shared memory holds only bytes, a ring of
// kFp8NarrowStages pages. Two forms, by the rows:
//   up to 16: mma.sync m16n8k16 with K and V as the B operand (fp8_narrow_mma_sync.cuh);
//   17-32: WGMMA m64n32k16 with the operands swapped, K and V as the register A operand and the
//     rows as N (fp8_narrow_wgmma.cuh).
//
// Grid, metadata, splits and combine kernel are the split-KV kernel's: (1, h_kv, num_sm_parts),
// one CTA per SM, 384 threads.
//   warp 8 (loading; its warpgroup gives its registers to the consumers): for each page of 64
//     tokens, its block ids and the TMA boxes of its bytes (fp8_staged.cuh's five boxes, packed:
//     40 KB) into the next stage once it is free; one-token pages (a kernel of their own) all
//     four warps of the warpgroup copy with cp.async instead;
//   warpgroups 0 and 1 (consumers), the pages in turn: per page, the form's S, online softmax
//     (the row max agreed among the group's four warps through shared memory) and O += P V; one
//     arrival per warp frees the stage. At a request's end the second group's rows merge into the
//     first's, which writes them.
// Q (bf16, TMA boxes of 64 rows) becomes fp16 once per request: in place, permuted (WGMMA form), or
// as MMA fragments in the boxes' unused rows (mma.sync form).
#include <cuda/std/cstdint>
#include <cuda/std/type_traits>

#include "common/error.cuh"
#include "common/numeric.cuh"
#include "common/pdl.cuh"
#include "common/sync.cuh"
#include "common/tma.cuh"
#include "mla/fp8_narrow_common.cuh"
#include "mla/fp8_narrow_mma_sync.cuh"
#include "mla/fp8_narrow_wgmma.cuh"

namespace flashmla {

__device__ __forceinline__ uint32_t stage_address(NarrowStorage& st, int stage) {
    return smem_u32(st.stage[stage]);
}

// One-token pages: the four loading warps copy page `stage`'s 64 tokens themselves (cp.async),
// where TMA would take five boxes a token (with boxes that small, page 1 took up to 8 times page
// 64's time: docs/perf-notes.md section 41); warp w takes tokens 16w to 16w + 15. Lane k holds
// the blocks of tokens k and k + 32. Eight lanes copy a token's row of each box, 16 bytes a lane,
// four tokens per instruction, into the boxes' 128-byte swizzle as TMA stores them; box 4's bytes
// past the 576-byte row are zeros, as TMA's fill, and so is every byte of a token past the
// request (block num_blocks). Each lane then accounts for its bytes on `full` and arrives there
// once its copies have landed (the barrier counts these 128 arrivals: kernel prologue).
__device__ __forceinline__ void copy_token_page(const SplitKVParams& p, uint32_t stage, uint32_t full,
                                                const int (&block)[2], int warp) {
    const int lane = threadIdx.x % 32, chunk = lane % 8;            // chunk: 16 of a box row's bytes
    const uint8_t* head = p.cache + blockIdx.y * p.cache_head_stride + chunk * 16;
    const int half_block = warp < 2 ? block[0] : block[1];           // tokens 32 (warp / 2) + lane
    // token 16 warp + lane / 8 + 4 j; four rows on, its chunks' swizzle differs in bit 2 (row % 8)
    const int first = 16 * warp + lane / 8;
    const uint32_t first_dst = swizzled_chunk(stage, first, chunk), next_dst = swizzled_chunk(stage, first + 4, chunk);
    #pragma unroll 1
    for (int j = 0; j < 4; ++j) {
        const int id = __shfl_sync(0xffffffffu, half_block, (first + 4 * j) % 32);
        const bool inside = id < p.num_blocks;
        const uint8_t* src = head + (inside ? id : 0) * p.cache_block_stride;
        const uint32_t dst = (j % 2 ? next_dst : first_dst) + (j / 2) * 8 * kFp8StagedRowBytes;
        copy_staged_chunks(src, inside, chunk, [&](int box) { return dst + box * kStagedBoxBytes; });
    }
    mbarrier_complete_tx(full, kStagedPageBytes / 128);             // 4 tokens x 5 boxes x 16 bytes
    cp_async_arrive_noinc(full);
}

// The loading warp: every page of the part's requests, in order, into the ring. Each lane loads
// the pieces lane and lane + 32 of a page (a piece: min(page_block_size, 64) rows of one cache
// block, as in the split-KV kernel); a piece past the request's length reads block num_blocks,
// which TMA fills with zeros without reading. A bad block id loads block 0 and flags the page.
// kTokenPages (one-token pages): the four warps of the loading warpgroup each read every block
// id of a page and copy a quarter of its tokens (copy_token_page); warp 0 alone flags and
// announces the page, and has the ids of the page after next fetched into L2.
template <bool kTokenPages>
__device__ __forceinline__ void load_pages(const SplitKVParams& p, NarrowStorage& st, const SchedRow& row) {
    const int lane = threadIdx.x % 32, warp = kTokenPages ? threadIdx.x / 32 % 4 : 0;
    const int pieces = kBlockN >> p.piece_shift;
    int n = 0;                                                   // pages issued
    #pragma unroll 1
    for (int req = row.range.x; req <= row.end_req; ++req) {
        const RequestSpan span = dense_request_span(p, 0, req, row.range);
        const int* table = p.block_table + req * p.block_table_stride;
        #pragma unroll 1
        for (int page = span.first_page; page < span.end_page; ++page, ++n) {
            const int stage = n % kFp8NarrowStages;
            // The page's block ids (pieces lane and lane + 32), both loads issued before either is
            // checked (a check's error report would order them) and before the wait, so that their
            // latency overlaps it.
            const auto token = [&](int k) { return page * kBlockN + ((lane + 32 * k) << p.piece_shift); };
            const auto column = [&](int k) { return token(k) >> p.page_shift; };
            const auto reads = [&](int k) { return lane + 32 * k < pieces && token(k) < span.seqlen; };
            int block[2];
            #pragma unroll
            for (int k = 0; k < 2; ++k) block[k] = reads(k) ? table[column(k)] : p.num_blocks;
            if (n >= kFp8NarrowStages) mbarrier_wait(smem_u32(&st.empty[stage]), (n / kFp8NarrowStages - 1) & 1);
            bool bad = false;
            #pragma unroll
            for (int k = 0; k < 2; ++k) {
                if (reads(k) && static_cast<unsigned>(block[k]) >= static_cast<unsigned>(p.num_blocks)) {
                    if (warp == 0) report_error(p.error, FLASHMLA_ERROR_BLOCK_ID, req, column(k), block[k], p.num_blocks);
                    block[k] = 0;
                    bad = true;
                }
            }
            const uint32_t full = smem_u32(&st.full[n % kNarrowGroups][stage]);   // the page's group's
            bad = __any_sync(0xffffffffu, bad);
            if (warp == 0 && lane == 0) {
                st.bad_page[stage] = bad;
                mbarrier_arrive_expect_tx(full, kStagedPageBytes);
            }
            __syncwarp();
            if constexpr (kTokenPages) {
                copy_token_page(p, stage_address(st, stage), full, block, warp);
                if (warp == 0) prefetch_token_page_ids(table, page + 2, span.seqlen, lane);
                continue;
            }
            #pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int piece = lane + 32 * k;
                if (piece >= pieces) continue;
                const int first_row = piece << p.piece_shift;
                const int cache_row = (page * kBlockN + first_row) & (p.page_block_size - 1);
                const uint32_t dst = stage_address(st, stage) + first_row * kFp8StagedRowBytes;
                #pragma unroll
                for (int box = 0; box < kStagedBoxes; ++box) {
                    tma_load_4d(&p.tma_kv, full, dst + box * kStagedBoxBytes, box * kFp8StagedRowBytes, cache_row,
                                blockIdx.y, block[k], L2Hint::kEvictFirst);
                }
            }
        }
    }
}

// The consumer warps: the part's requests [range.x, end_req], from the first Q load to the last
// output, with the form's math (`Rows`).
template <typename Rows>
__device__ __forceinline__ void consume_pages(Rows& rows, const SchedRow& row) {
    const SplitKVParams& p = rows.p;
    NarrowStorage& st = rows.st;
    const int begin_req = row.range.x;
    if (threadIdx.x == 0) rows.load_q(begin_req);
    #pragma unroll 1
    for (int req = begin_req; req <= row.end_req; ++req) {
        const RequestSpan span = dense_request_span(p, 0, req, row.range);
        if (span.bad && threadIdx.x == 0) {
            report_error(p.error, FLASHMLA_ERROR_SEQLEN_RANGE, req, p.page_block_size, p.seqlens[req],
                         p.max_blocks_per_seq);
        }
        rows.begin_request(span);
        mbarrier_wait(smem_u32(&st.bar_q), (req - begin_req) & 1);
        rows.prepare_q();

        // Pages from `masked_page` on hold a masked token of some row, or the request's end.
        const int masked_page = (span.seqlen - (p.causal ? p.s_q - 1 : 0)) / kBlockN;
        bool bad = false;
        // The group's pages of the request: every kGroups-th from its first (n counts every page).
        const int end_n = rows.n + (span.end_page - span.first_page);
        const int skip = rows.pages_to_mine();
        rows.n += skip;
        #pragma unroll 1
        for (int page = span.first_page + skip; rows.n < end_n; page += Rows::kGroups, rows.n += Rows::kGroups) {
            const int stage = rows.n % kFp8NarrowStages;
            mbarrier_wait(smem_u32(&st.full[rows.group][stage]), (rows.n / kStageRound) & 1);
            bad |= st.bad_page[stage] != 0;
            const int first_token = page * kBlockN;
            if (page >= masked_page) {
                rows.template page_step<true>(stage_address(st, stage), first_token, span.seqlen - first_token);
            } else {
                rows.template page_step<false>(stage_address(st, stage), first_token, kBlockN);
            }
            __syncwarp();
            if (rows.lane == 0) mbarrier_arrive(smem_u32(&st.empty[stage]));
        }
        rows.n = end_n;

        float sums[Rows::kRowsPerThread];
        rows.reduce_sums(sums);
        const bool stores = rows.merge_groups(sums, bad);
        if (req < row.end_req) {
            if (threadIdx.x == 0) {                           // every warp is past Q (reduce_sums, merge_groups)
                fence_smem_for_async_proxy();
                rows.load_q(req + 1);
            }
        } else {
            pdl_allow_dependents();                           // the combine kernel may start
        }
        // the row's split index read again here: kept over the pages, the mma.sync form spilled it
        if (stores) rows.store(rows.output(req, sched_row_here(p), span, bad), sums);
    }
}

// The form for kRows: kFp8NarrowMmaSyncRows (mma.sync) or kFp8NarrowRows (WGMMA).
template <int kRows>
using NarrowRows = cuda::std::conditional_t<kRows == NarrowMmaSyncRows::kRows, NarrowMmaSyncRows, NarrowWgmmaRows>;

// kTokenPages: the form for a page_block_size of 1 (copy_token_page).
template <int kRows, bool kTokenPages = false>
__global__ void __launch_bounds__(NarrowRows<kRows>::kThreads, 1)
fp8_narrow_mla_kernel(const __grid_constant__ SplitKVParams p) {
    using Rows = NarrowRows<kRows>;
    static_assert(Rows::kRows == kRows, "a form's rows");
    extern __shared__ __align__(1024) unsigned char smem[];
    auto& st = *reinterpret_cast<NarrowStorage*>(smem);
    if (threadIdx.x == 0) {
        tma_prefetch_descriptor(&p.tma_q);
        tma_prefetch_descriptor(&p.tma_kv);
        mbarrier_init(smem_u32(&st.bar_q), 1);
        for (int s = 0; s < kFp8NarrowStages; ++s) {
            // the loading warp's byte count, and at one-token pages an arrival per loading lane (copy_token_page)
            for (int g = 0; g < kNarrowGroups; ++g) mbarrier_init(smem_u32(&st.full[g][s]), kTokenPages ? 1 + 128 : 1);
            mbarrier_init(smem_u32(&st.empty[s]), kNarrowWarps);                  // one arrival per consumer warp
        }
        mbarrier_init_fence();
    }
    __syncthreads();

    pdl_wait_for_producers();                                        // metadata and inputs from here on
    const SchedRow row = sched_row(p, p.sched_meta + blockIdx.z * kSchedMetaInts);
    if (!part_is_runnable(p, row, -1)) return;
    if (threadIdx.x >= Rows::kConsumerThreads) {                    // the loading warp (of its warpgroup)
        warpgroup_release_registers<Rows::kLoaderRegs>();
        if (kTokenPages || threadIdx.x < Rows::kConsumerThreads + 32) load_pages<kTokenPages>(p, st, row);
        return;
    }
    warpgroup_claim_registers<Rows::kConsumerRegs>();
    Rows rows(p, st);
    consume_pages(rows, row);
}

}  // namespace flashmla
