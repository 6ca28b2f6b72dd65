// Online softmax of the "seesaw" schedule, split between the two warpgroups.
//
// Both warpgroups hold the same 64 query rows; warpgroup 0 owns O[:, :256] and the even page of
// each pair, warpgroup 1 owns O[:, 256:] and the odd page. They share one running max per row
// (row_max, log2 domain) and publish their rescale factors through shared memory:
//   wg0: m0 = max(m, rowmax(S0)); scale0 = 2^(m - m0); O_L *= scale0; P0 = 2^(S0 - m0)
//   wg1: m1 = max(m0, rowmax(S1)); scale1 = 2^(m0 - m1); O_R *= scale0*scale1; P1 = 2^(S1 - m1)
//   wg0 later: O_L *= scale1 and P0 *= scale1 before O_L += P1 V1_L, O_R += P0 V0_R.
//
// Fragment layout (WGMMA accumulator, 64 rows per warpgroup): thread t of the warpgroup holds rows
// 16*(t/32) + (t%32)/4 and that + 8; element i of a 64-column fragment sits in row half (i/2)%2,
// column 8*(i/4) + 2*(t%4) + i%2.
#pragma once
#include <cute/tensor.hpp>

#include "mla/config.cuh"

namespace flashmla {

using namespace cute;

// Masked logits are set to -inf: their exp2 is exactly 0 whatever the (positive) softmax scale.
// row_max starts finite, so that a row whose first pages are all masked rescales by
// exp2(kRowMaxInit - kRowMaxInit) = 1 and never computes inf - inf.
constexpr float kMaskedScore = -kInf;
constexpr float kRowMaxInit = -1e30f;

__device__ __forceinline__ int fragment_row(int half, int idx_in_wg) {
    return (idx_in_wg / 32) * 16 + half * 8 + (idx_in_wg % 32) / 4;
}

__device__ __forceinline__ int fragment_col(int i, int idx_in_wg) {
    return (i / 4) * 8 + (idx_in_wg % 4) * 2 + (i % 2);
}

// The four threads holding a row are consecutive lanes (a quad).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Per-request row state of one thread: its two rows' visible-token limits and partial sums.
struct RowState {
    int right_border[2];   // tokens >= this are masked (end of sequence, causal mask, split end)
    float sum[2];          // partial softmax denominators over this thread's columns
};

// Mask (optional) and return the scaled row max of `s` for row half `half`.
template <bool kMask, typename FragS>
__device__ __forceinline__ float masked_row_max(FragS& s, int half, int first_token, int border,
                                                float scale_log2, int idx_in_wg) {
    float mx = kMaskedScore;
    CUTE_UNROLL
    for (int i = half * 2; i < size(s); i += 4) {
        CUTE_UNROLL
        for (int e = 0; e < 2; ++e) {
            if constexpr (kMask) {
                if (first_token + fragment_col(i + e, idx_in_wg) >= border) s(i + e) = kMaskedScore;
            }
            mx = fmaxf(mx, s(i + e));
        }
    }
    return quad_max(mx) * scale_log2;
}

// S <- 2^(S*scale - m) in place (fp32 kept for warpgroup 0's later rescale), a copy in the
// input precision as the next WGMMA's A operand; returns the row's partial sum.
template <typename FragS, typename FragP>
__device__ __forceinline__ float exponentiate(FragS& s, FragP& p, int half, float m, float scale_log2) {
    using Element = typename FragP::value_type;
    float sum = 0.0f;
    CUTE_UNROLL
    for (int i = half * 2; i < size(s); i += 4) {
        CUTE_UNROLL
        for (int e = 0; e < 2; ++e) {
            const float x = exp2f(fmaf(s(i + e), scale_log2, -m));
            s(i + e) = x;
            p(i + e) = Element(x);
            sum += x;
        }
    }
    return sum;
}

template <typename FragO>
__device__ __forceinline__ void scale_rows(FragO& o, int half, float factor) {
    CUTE_UNROLL
    for (int i = half * 2; i < size(o); i += 4) {
        o(i) *= factor;
        o(i + 1) *= factor;
    }
}

// Warpgroup 0, even page: update the shared max, publish scale0, rescale O_L, S0 -> P0.
template <bool kMask, typename FragS, typename FragP, typename FragO>
__device__ __forceinline__ void wg0_softmax(FragS& s, FragP& p, FragO& o, RowState& rows,
                                            float* row_max, float* scale0, float scale_log2,
                                            int first_token, int idx_in_wg) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
        const int row = fragment_row(half, idx_in_wg);
        const float page_max = masked_row_max<kMask>(s, half, first_token, rows.right_border[half],
                                                     scale_log2, idx_in_wg);
        const float m_old = row_max[row];
        const float m_new = fmaxf(m_old, page_max);
        const float rescale = exp2f(m_old - m_new);
        __syncwarp();   // the quad has read row_max before it changes
        if (idx_in_wg % 4 == 0) {
            scale0[row] = rescale;
            row_max[row] = m_new;
        }
        scale_rows(o, half, rescale);
        rows.sum[half] = rows.sum[half] * rescale + exponentiate(s, p, half, m_new, scale_log2);
    }
}

// Warpgroup 1, odd page (absent if kNoPage): update the shared max after warpgroup 0, publish
// scale1, rescale O_R by scale0*scale1, S1 -> P1.
template <bool kNoPage, bool kMask, typename FragS, typename FragP, typename FragO>
__device__ __forceinline__ void wg1_softmax(FragS& s, FragP& p, FragO& o, RowState& rows,
                                            float* row_max, const float* scale0, float* scale1,
                                            float scale_log2, int first_token, int idx_in_wg) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
        const int row = fragment_row(half, idx_in_wg);
        float rescale = 1.0f, page_sum = 0.0f;
        if constexpr (!kNoPage) {
            const float page_max = masked_row_max<kMask>(s, half, first_token, rows.right_border[half],
                                                         scale_log2, idx_in_wg);
            const float m_old = row_max[row];
            const float m_new = fmaxf(m_old, page_max);
            rescale = exp2f(m_old - m_new);
            __syncwarp();
            if (idx_in_wg % 4 == 0) row_max[row] = m_new;
            page_sum = exponentiate(s, p, half, m_new, scale_log2);
        }
        if (idx_in_wg % 4 == 0) scale1[row] = rescale;
        const float o_rescale = rescale * scale0[row];
        scale_rows(o, half, o_rescale);
        rows.sum[half] = rows.sum[half] * o_rescale + page_sum;
    }
}

// Warpgroup 0, once scale1 is known: P0 * scale1 in the input precision (for warpgroup 1).
template <typename FragS, typename FragP>
__device__ __forceinline__ void wg0_rescale_p(FragS const& s, FragP& p, const float* scale1, int idx_in_wg) {
    using Element = typename FragP::value_type;
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
        const float factor = scale1[fragment_row(half, idx_in_wg)];
        CUTE_UNROLL
        for (int i = half * 2; i < size(s); i += 4) {
            p(i) = Element(s(i) * factor);
            p(i + 1) = Element(s(i + 1) * factor);
        }
    }
}

// Warpgroup 0, once scale1 is known: O_L and its sums follow the max of the odd page.
template <typename FragO>
__device__ __forceinline__ void wg0_rescale_o(FragO& o, RowState& rows, const float* scale1, int idx_in_wg) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
        const float factor = scale1[fragment_row(half, idx_in_wg)];
        scale_rows(o, half, factor);
        rows.sum[half] *= factor;
    }
}

}  // namespace flashmla
