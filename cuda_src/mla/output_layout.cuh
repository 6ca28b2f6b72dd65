// Where a query row's results go: lse's index, and the attention sink's factor on its output.
#pragma once
#include <cuda/std/cstdint>

#include "common/numeric.cuh"

namespace flashmla {

// lse is [batch][h_q][s_q]. The sparse kernel folds the query tokens into the request axis
// (request = b * sparse_s_q + s, one token per request); dense requests hold s_q tokens each.
__device__ __forceinline__ int64_t lse_index(int request, int head, int token, int h_q, int s_q,
                                             int sparse_s_q) {
    const int b = request / sparse_s_q;
    const int s = request % sparse_s_q + token;
    return ((int64_t)b * h_q + head) * ((int64_t)s_q * sparse_s_q) + s;
}

// A row's lse from its softmax sum and running max (log2 domain): the final lse in natural log,
// or a split's in log2 for the combine kernel; a zero sum (no visible token, or overflow) gives
// +inf (final) or -inf (split, weight 0), a bad request NaN.
__device__ __forceinline__ bool no_visible_token(float sum) { return sum == 0.0f || sum != sum; }

__device__ __forceinline__ float row_lse(float sum, float max_log2, bool bad, bool split) {
    if (bad) return kNaN;
    if (no_visible_token(sum)) return split ? -kInf : kInf;
    return split ? log2f(sum) + max_log2 : logf(sum) + max_log2 * kLn2;
}

// The attention sink scales a row's output by exp(lse) / (exp(lse) + exp(sink)); lse itself is
// unchanged. `lse_log2`: the row's lse in the log2 domain, finite; `sink_log2`: the row's sink
// times log2(e), -inf without a sink (factor 1).
__device__ __forceinline__ float sink_factor_log2(float sink_log2, float lse_log2) {
    return 1.0f / (1.0f + exp2f(sink_log2 - lse_log2));
}

// The same from attn_sink itself; lse +inf (no visible token: the output is already 0) gives 1.
__device__ __forceinline__ float sink_factor(const float* attn_sink, int head, float lse_log2) {
    if (attn_sink == nullptr || lse_log2 == kInf) return 1.0f;
    return sink_factor_log2(attn_sink[head] * kLog2e, lse_log2);
}

}  // namespace flashmla
