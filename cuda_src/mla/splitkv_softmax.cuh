// Online softmax of the "seesaw" schedule, split between the two warpgroups.
//
// Both warpgroups hold the same 64 query rows; warpgroup 0 owns O[:, :256] and the even page of
// each pair, warpgroup 1 owns O[:, 256:] and the odd page. They share one running max per row
// (row_max, log2 domain) and publish their rescale factors through shared memory:
//   wg0: m0 = max(m, rowmax(S0)); scale0 = 2^(m - m0); O_L *= scale0; P0 = 2^(S0 - m0)
//   wg1: m1 = max(m0, rowmax(S1)); scale1 = 2^(m0 - m1); O_R *= scale0*scale1; P1 = 2^(S1 - m1)
//   wg0 later: O_L *= scale1 and P0 *= scale1 before O_L += P1 V1_L, O_R += P0 V0_R.
//
// The running max is lazy: it moves only when a page's max exceeds it by more than
// kStaleMaxLog2, so P = 2^(S - m) <= 2^kStaleMaxLog2 (exact in fp32, and bf16/fp16 keep their
// relative precision), and after the first pages the rescale factors are exactly 1. A warp
// whose 16 rows all have factor 1 skips the rescale of its O fragment (128 multiplies per
// thread, up to three times per page pair): bit-identical to multiplying by 1.
//
// Fragment layout (WGMMA accumulator, 64 rows per warpgroup): thread t of the warpgroup holds rows
// 16*(t/32) + (t%32)/4 and that + 8; element i of a 64-column fragment sits in row half (i/2)%2,
// column 8*(i/4) + 2*(t%4) + i%2.
#pragma once
#include <cute/tensor.hpp>

#include "common/numeric.cuh"
#include "mla/config.cuh"

namespace flashmla {

using namespace cute;

// Masked logits are set to -inf: their exp2 is exactly 0 whatever the (positive) softmax scale.
// row_max starts finite, so that a row whose first pages are all masked rescales by
// exp2(kRowMaxInit - kRowMaxInit) = 1 and never computes inf - inf.
constexpr float kMaskedScore = -kInf;
constexpr float kRowMaxInit = -1e30f;
constexpr float kStaleMaxLog2 = 8.0f;
// P rounded to e4m3 (an e4m3 q): the max moves at 2^4, and P times 2^4 (kE4m3PScale) goes into
// e4m3 (<= 2^8 of its 448): a weight turns subnormal (3 bits fewer) only below 2^-10 of the
// running max, and is lost below 2^-14. The max moves to whole numbers, so that the rescale
// factors are powers of two, exact on e4m3 values (rescale_e4m3_p).
constexpr float kStaleMaxLog2E4m3P = 4.0f;
constexpr float kE4m3PScale = 16.0f;

// The new running max of a row: unchanged unless the page's max passes it by kStaleMaxLog2
// (e4m3 P: kStaleMaxLog2E4m3P, and rounded up to a whole number). NaN scores leave it unchanged
// (as fmaxf would) and propagate through P.
template <bool kE4m3>
__device__ __forceinline__ float lazy_row_max(float m_old, float page_max) {
    if constexpr (kE4m3) return page_max > m_old + kStaleMaxLog2E4m3P ? ceilf(page_max) : m_old;
    return page_max > m_old + kStaleMaxLog2 ? page_max : m_old;
}

// Whether any of the warp's rows has a rescale factor other than 1 (warp-uniform).
__device__ __forceinline__ bool warp_needs_rescale(const float (&factor)[2]) {
    return __any_sync(0xffffffffu, factor[0] != 1.0f || factor[1] != 1.0f);
}

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

// Mask (optional) and return the scaled row max of `s` for row half `half`. kMask: tokens at
// or past `border`; kTokenMask (sparse): tokens whose bit in `token_valid` is 0.
template <bool kMask, bool kTokenMask, typename FragS>
__device__ __forceinline__ float masked_row_max(FragS& s, int half, int first_token, int border,
                                                uint64_t token_valid, float scale_log2, int idx_in_wg) {
    float mx = kMaskedScore;
    // This thread's columns are fragment_col(0) plus compile-time offsets: one shift here leaves
    // constant bit tests below (per-column shift amounts in registers spill under older ptxas).
    const uint64_t my_valid = token_valid >> fragment_col(0, idx_in_wg);
    CUTE_UNROLL
    for (int i = half * 2; i < size(s); i += 4) {
        CUTE_UNROLL
        for (int e = 0; e < 2; ++e) {
            if constexpr (kMask) {
                if (first_token + fragment_col(i + e, idx_in_wg) >= border) s(i + e) = kMaskedScore;
            }
            if constexpr (kTokenMask) {
                if (!((my_valid >> fragment_col(i + e, 0)) & 1)) s(i + e) = kMaskedScore;
            }
            mx = fmaxf(mx, s(i + e));
        }
    }
    return quad_max(mx) * scale_log2;
}

// P rounded to e4m3 (an e4m3 q's P V), not elementwise like a 16-bit P.
template <typename FragP>
constexpr bool kE4m3P = cute::is_same_v<typename FragP::value_type, cutlass::float_e4m3_t>;

// P (S after exponentiate) times the rows' factors -> e4m3 A operand of P V. Register r of k-step
// ks holds row half r % 2 and the S elements 16 ks + 8 (r / 2) + 2 (r % 2) + {0, 1, 4, 5}, the
// tokens 32 ks + 16 (r / 2) + 2 (idx % 4) + {0, 1, 8, 9}: so WGMMA's k index 32 ks + 16 h + 4 q + i
// (thread quad position q) is token 32 ks + 16 h + 8 (i / 2) + 2 q + i % 2, the order in which
// the expander writes V^T's rows (fp8_expand.cuh). P is scaled by kE4m3PScale (O divided by it
// in output_factors).
template <typename FragS, typename FragP>
__device__ __forceinline__ void p_to_e4m3(FragS const& s, FragP& p, const float (&factor)[2]) {
    auto words = recast<uint32_t>(p);
    CUTE_UNROLL
    for (int ks = 0; ks < 2; ++ks) {
        CUTE_UNROLL
        for (int r = 0; r < 4; ++r) {
            const int e = 16 * ks + 8 * (r / 2) + 2 * (r % 2);
            const float f = factor[r % 2] * kE4m3PScale;
            words(4 * ks + r) = f32x4_to_e4m3x4(s(e) * f, s(e + 1) * f, s(e + 4) * f, s(e + 5) * f);
        }
    }
}

// An e4m3 P (p_to_e4m3) times its rows' factors, powers of two (lazy_row_max): exact but where a
// weight turns subnormal, as if computed from fp32. Through fp16, which holds every e4m3 value.
template <typename FragP>
__device__ __forceinline__ void rescale_e4m3_p(FragP& p, const float (&factor)[2]) {
    auto words = recast<uint32_t>(p);
    CUTE_UNROLL
    for (int r = 0; r < 8; ++r) {
        const uint32_t f = fp16x2_splat(factor[r % 2]);
        const Fp16x2Pair pair = e4m3x4_to_fp16x2(words(r));
        words(r) = fp16x2_to_e4m3x2(fp16x2_mul(pair.lo, f)) | fp16x2_to_e4m3x2(fp16x2_mul(pair.hi, f)) << 16;
    }
}

// S <- 2^(S*scale - m) in place (fp32 kept for warpgroup 0's later rescale), a copy in the
// input precision as the next WGMMA's A operand (e4m3: p_to_e4m3 once both row halves are
// done); returns the row's partial sum.
template <typename FragS, typename FragP>
__device__ __forceinline__ float exponentiate(FragS& s, FragP& p, int half, float m, float scale_log2) {
    using Element = typename FragP::value_type;
    float sum = 0.0f;
    CUTE_UNROLL
    for (int i = half * 2; i < size(s); i += 4) {
        CUTE_UNROLL
        for (int e = 0; e < 2; ++e) {
            const float x = exp2_approx(fmaf(s(i + e), scale_log2, -m));
            s(i + e) = x;
            if constexpr (!kE4m3P<FragP>) p(i + e) = Element(x);
            sum += x;
        }
    }
    return sum;
}

// O's rows times their factors, skipped when the whole warp's factors are 1.
template <typename FragO>
__device__ __forceinline__ void scale_rows(FragO& o, const float (&factor)[2]) {
    if (!warp_needs_rescale(factor)) return;
    CUTE_UNROLL
    for (int i = 0; i < size(o); i += 2) {
        o(i) *= factor[(i / 2) % 2];
        o(i + 1) *= factor[(i / 2) % 2];
    }
}

// Warpgroup 0, even page: update the shared max, publish scale0, rescale O_L, S0 -> P0.
template <bool kMask, typename FragS, typename FragP, typename FragO>
__device__ __forceinline__ void wg0_softmax(FragS& s, FragP& p, FragO& o, RowState& rows,
                                            float* row_max, float* scale0, float scale_log2,
                                            int first_token, int idx_in_wg) {
    float rescale[2];
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
        const int row = fragment_row(half, idx_in_wg);
        const float page_max = masked_row_max<kMask, false>(s, half, first_token, rows.right_border[half],
                                                            ~0ull, scale_log2, idx_in_wg);
        const float m_old = row_max[row];
        const float m_new = lazy_row_max<kE4m3P<FragP>>(m_old, page_max);
        rescale[half] = exp2_approx(m_old - m_new);
        __syncwarp();   // the quad has read row_max before it changes
        if (idx_in_wg % 4 == 0) {
            scale0[row] = rescale[half];
            row_max[row] = m_new;
        }
        rows.sum[half] = rows.sum[half] * rescale[half] + exponentiate(s, p, half, m_new, scale_log2);
    }
    if constexpr (kE4m3P<FragP>) {
        const float unit[2] = {1.0f, 1.0f};
        p_to_e4m3(s, p, unit);
    }
    scale_rows(o, rescale);
}

// Warpgroup 1, odd page (absent if kNoPage): update the shared max after warpgroup 0, publish
// scale1, rescale O_R by scale0*scale1, S1 -> P1.
template <bool kNoPage, bool kMask, typename FragS, typename FragP, typename FragO>
__device__ __forceinline__ void wg1_softmax(FragS& s, FragP& p, FragO& o, RowState& rows,
                                            float* row_max, const float* scale0, float* scale1,
                                            float scale_log2, int first_token, int idx_in_wg) {
    float o_rescale[2];
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
        const int row = fragment_row(half, idx_in_wg);
        float rescale = 1.0f, page_sum = 0.0f;
        if constexpr (!kNoPage) {
            const float page_max = masked_row_max<kMask, false>(s, half, first_token, rows.right_border[half],
                                                                ~0ull, scale_log2, idx_in_wg);
            const float m_old = row_max[row];
            const float m_new = lazy_row_max<kE4m3P<FragP>>(m_old, page_max);
            rescale = exp2_approx(m_old - m_new);
            __syncwarp();
            if (idx_in_wg % 4 == 0) row_max[row] = m_new;
            page_sum = exponentiate(s, p, half, m_new, scale_log2);
        }
        if (idx_in_wg % 4 == 0) scale1[row] = rescale;
        o_rescale[half] = rescale * scale0[row];
        rows.sum[half] = rows.sum[half] * o_rescale[half] + page_sum;
    }
    if constexpr (kE4m3P<FragP> && !kNoPage) {
        const float unit[2] = {1.0f, 1.0f};
        p_to_e4m3(s, p, unit);
    }
    scale_rows(o, o_rescale);
}

// Warpgroup 0, once scale1 is known: P0 * scale1 in the input precision (for warpgroup 1; an e4m3
// P from itself, so that S's registers are free for the next QK^T).
// `factor`: the thread's two rows' scale1. Factors of 1 leave P as wg0_softmax converted it.
template <typename FragS, typename FragP>
__device__ __forceinline__ void wg0_rescale_p(FragS const& s, FragP& p, const float (&factor)[2]) {
    using Element = typename FragP::value_type;
    if (!warp_needs_rescale(factor)) return;
    if constexpr (kE4m3P<FragP>) {
        rescale_e4m3_p(p, factor);
    } else {
        CUTE_UNROLL
        for (int i = 0; i < size(s); i += 2) {
            p(i) = Element(s(i) * factor[(i / 2) % 2]);
            p(i + 1) = Element(s(i + 1) * factor[(i / 2) % 2]);
        }
    }
}

// Warpgroup 0, once scale1 is known: O_L and its sums follow the max of the odd page.
template <typename FragO>
__device__ __forceinline__ void wg0_rescale_o(FragO& o, RowState& rows, const float (&factor)[2]) {
    rows.sum[0] *= factor[0];
    rows.sum[1] *= factor[1];
    scale_rows(o, factor);
}

// This thread's two rows' scale1, published by warpgroup 1.
__device__ __forceinline__ void read_scale1(const float* scale1, int idx_in_wg, float (&factor)[2]) {
    factor[0] = scale1[fragment_row(0, idx_in_wg)];
    factor[1] = scale1[fragment_row(1, idx_in_wg)];
}

}  // namespace flashmla
