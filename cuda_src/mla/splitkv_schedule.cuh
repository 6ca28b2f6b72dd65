// What a split-KV CTA reads: its part's row of the scheduler metadata, and per request the
// pages of that part (the split-KV kernel and the dense FP8 cache's narrow kernel).
#pragma once
#include "common/error.cuh"
#include "common/sync.cuh"
#include "mla/config.cuh"
#include "mla/params.cuh"

namespace flashmla {

// Rows of a 64-row block that belong to query token s see the first
// seqlen - (s_q - 1 - s) tokens (causal MTP). Rows past the query count mask nothing.
__device__ __forceinline__ int causal_mask_len(const SplitKVParams& p, int m_block, int row) {
    const int q_row = m_block * kBlockM + row;
    return q_row < p.q_rows ? p.s_q - 1 - q_row / p.heads_per_kv : 0;
}

// Pages holding `tokens` tokens (tokens >= 0; no overflow at 2^31 - 1).
__device__ __forceinline__ int pages_of(int tokens) {
    return tokens / kBlockN + (tokens % kBlockN != 0);
}

// The pages [first_page, end_page) of request `req` that a CTA reads, given its scheduler range
// {begin_req, begin_token, end_req, end_token}; `whole`: the range covers the whole request (its
// output is final, else a split for the combine kernel). Causal: pages no row of the block sees
// are dropped. `bad`: the request's length is outside [0, page_block_size * block_table columns]; it then
// reads nothing, and whether its output is final or a split is what num_splits says (the
// combine kernel merges exactly the requests with several splits). The range never extends past
// the request's length, whatever the metadata says.
struct RequestSpan {
    int seqlen, first_page, end_page;
    bool whole, bad;
};

// Sparse: every request (one query token) was scheduled as topk entries long; only the first
// topk_length[b] of them count, so pages past those are not read (but `whole` is the schedule's).
__device__ __forceinline__ RequestSpan sparse_request_span(const SplitKVParams& p, int req, int4 range) {
    RequestSpan r;
    const int pages = pages_of(p.topk);
    r.first_page = req == range.x ? max(range.y, 0) / kBlockN : 0;
    r.end_page = req == range.z ? min(pages_of(max(range.w, 0)), pages) : pages;
    r.whole = r.first_page == 0 && r.end_page == pages;
    r.seqlen = p.topk_length ? min(max(p.topk_length[req / p.sparse_s_q], 0), p.topk) : p.topk;
    r.end_page = min(r.end_page, pages_of(r.seqlen));
    r.bad = false;
    return r;
}

__device__ __forceinline__ RequestSpan dense_request_span(const SplitKVParams& p, int m_block, int req, int4 range) {
    RequestSpan r;
    const int seqlen = p.seqlens[req];
    r.bad = seqlen < 0 || seqlen > (long long)p.max_blocks_per_seq * p.page_block_size;
    r.seqlen = r.bad ? 0 : seqlen;
    const int seq_pages = pages_of(r.seqlen);
    r.first_page = req == range.x ? max(range.y, 0) / kBlockN : 0;
    r.end_page = req == range.z ? min(pages_of(max(range.w, 0)), seq_pages) : seq_pages;
    r.whole = r.bad ? (long long)p.num_splits[req + 1] - p.num_splits[req] <= 1
                    : r.first_page == 0 && r.end_page == seq_pages;
    if (p.causal) {
        // The last row has the shortest mask; pages past its limit are skipped and rows with
        // longer masks are cut by RowState::right_border (rows of one block differ by < 64
        // tokens, so only the last two pages need masking).
        const int common_mask = causal_mask_len(p, m_block, kBlockM - 1);
        r.end_page = min(r.end_page, pages_of(max(r.seqlen - common_mask, 0)));
    }
    return r;
}

// One-token pages: the block-table entries of page `page` of a request of `seqlen` tokens (`table`:
// its row; 64 entries, 256 bytes, on at most three 128-byte lines) fetched into L2 by lanes 0-2
// of the calling warp, so that the loads of that page's block ids, a page or two later, hit L2
// where they would wait for DRAM (docs/perf-notes.md section 43).
__device__ __forceinline__ void prefetch_token_page_ids(const int* table, int page, int seqlen, int lane) {
    const int token = page * kBlockN + min(32 * lane, kBlockN - 1);   // the first, 33rd and last entry
    if (lane < 3 && token < seqlen) prefetch_l2(table + token);
}

// This CTA's row of the scheduler metadata (`meta`: its address; sched_row_here reads it again).
struct SchedRow {
    int4 range;           // begin_req, begin_token, end_req, end_token
    int end_req;          // range.z, within the batch
    int begin_split;      // the first split's index of begin_req
    int topk;             // the topk the metadata was scheduled for (-1: dense)
};

__device__ __forceinline__ SchedRow sched_row(const SplitKVParams& p, const int* meta) {
    SchedRow row;
    row.range = *reinterpret_cast<const int4*>(meta);
    const int4 kind = *reinterpret_cast<const int4*>(meta + 4);   // begin_split, topk, -, -
    row.end_req = min(row.range.z, p.batch - 1);
    row.begin_split = kind.x;
    row.topk = kind.y;
    return row;
}

// The same row read again where it is used, its address computed afresh: nothing of it stays
// live from the prologue.
__device__ __forceinline__ SchedRow sched_row_here(const SplitKVParams& p) {
    return sched_row(p, computed_here(p.sched_meta) + block_index_z_here() * kSchedMetaInts);
}

// The part's row is one this call can run: metadata of this kind of call (`topk`: the call's,
// -1 dense), a non-empty request range within the batch. Otherwise every CTA of the part returns
// (bad metadata is reported; an idle part is not an error) before anything is loaded.
__device__ __forceinline__ bool part_is_runnable(const SplitKVParams& p, const SchedRow& row, int topk) {
    if (row.topk != topk) {
        if (threadIdx.x == 0) report_error(p.error, FLASHMLA_ERROR_METADATA_KIND, blockIdx.z, 0, row.topk, topk);
        return false;
    }
    const int begin_req = row.range.x;
    if (begin_req >= p.batch) return false;                     // an idle part
    if (begin_req < 0 || row.end_req < begin_req) {             // not this batch's metadata
        if (threadIdx.x == 0) report_error(p.error, FLASHMLA_ERROR_SCHEDULE, begin_req, 0, row.range.z, p.batch);
        return false;
    }
    return true;
}

}  // namespace flashmla
