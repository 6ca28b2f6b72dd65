// Tile scheduler: splits the batch's KV pages across `num_sm_parts` persistent CTAs.
//
// A request costs (its pages + kFixedOverheadBlocks); every part gets a payload of about
// total_cost / num_sm_parts. Walking the requests in order, a part takes whole requests while they
// fit and otherwise the part of the next request that fits, which becomes one "split" of it.
// Output per part: [begin_req, begin_token, end_req, end_token, begin_split, topk, 0, 0], where
// topk is uniform_seqlen (sparse decoding: indices' last dim; -1 for dense decoding), which the
// split-KV kernel compares with its call's; and num_splits[i] = number of splits of requests < i
// (prefix sums, num_splits[0] = 0).
// flashmla_cupy/scheduler.py is the same algorithm in Python; the tests compare the two.
//
// Any int32 length is safe: a negative one is reported and scheduled as 0 (the split-KV kernel
// then writes NaN for that request), costs are summed in 64 bits, and pages are counted without
// overflowing at 2^31 - 1.
#include "common/error.cuh"
#include "mla/config.cuh"
#include "mla/params.cuh"

namespace flashmla {

__device__ __forceinline__ int pages_of(int seqlen, int block_n) {
    return seqlen / block_n + (seqlen % block_n != 0);
}

// Request i's length as given (sparse decoding: every request is topk tokens long).
__device__ __forceinline__ int request_len(const MetadataParams& p, int i) {
    return p.uniform_seqlen >= 0 ? p.uniform_seqlen : p.seqlens[i];
}

__device__ __forceinline__ int scheduled_seqlen(const MetadataParams& p, int i) {
    const int seqlen = request_len(p, i);
    if (seqlen < 0) report_error(p.error, FLASHMLA_ERROR_SEQLEN_NEGATIVE, i, 0, seqlen, 0);
    return max(seqlen, 0);
}

__global__ void __launch_bounds__(32, 1) mla_metadata_kernel(const __grid_constant__ MetadataParams p) {
    const int lane = threadIdx.x;
    const int overhead = p.fixed_overhead_blocks;

    long long total_cost = 0;
    for (int i = lane; i < p.batch; i += 32) {
        total_cost += pages_of(scheduled_seqlen(p, i), p.block_n) + overhead;
    }
    #pragma unroll
    for (int offset = 16; offset >= 1; offset /= 2) {
        total_cost += __shfl_xor_sync(0xffffffffu, total_cost, offset);
    }
    if (lane != 0) return;

    const long long payload = (total_cost + p.num_sm_parts - 1) / p.num_sm_parts + overhead;
    int req = 0, page = 0, split = 0, splits_so_far = 0;
    p.num_splits[0] = 0;
    for (int part = 0; part < p.num_sm_parts; ++part) {
        const int begin_req = req, begin_token = page * p.block_n, begin_split = split;
        long long budget = payload;
        while (req < p.batch) {
            const int pages_left = pages_of(max(request_len(p, req), 0), p.block_n) - page;
            if (budget >= pages_left + overhead) {          // the rest of this request fits
                splits_so_far += split + 1;
                p.num_splits[req + 1] = splits_so_far;
                budget -= pages_left + overhead;
                ++req;
                page = 0;
                split = 0;
            } else {                                         // take what fits, split the request
                if (budget - overhead > 0) {
                    page += int(budget - overhead);         // < pages_left: fits in an int
                    ++split;
                }
                break;
            }
        }
        int4* out = reinterpret_cast<int4*>(p.sched_meta + part * kSchedMetaInts);
        out[0] = make_int4(begin_req, begin_token,
                           page > 0 ? req : req - 1,
                           page > 0 ? page * p.block_n : max(request_len(p, req - 1), 0));
        out[1] = make_int4(begin_split, p.uniform_seqlen, 0, 0);
    }
}

}  // namespace flashmla
