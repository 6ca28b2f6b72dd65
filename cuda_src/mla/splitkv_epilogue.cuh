// Epilogue of one (request, split): normalize O by the softmax sum and write it out.
//
// * The request was not split: O in the input precision into [batch][q_rows][h_kv][512] (the
//   output itself when h_kv = 1), lse (natural log) into [batch][h_q][s_q].
// * Otherwise: fp32 O rows and the log2-domain lse into the split workspace, for the combine
//   kernel.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/array.h>

#include "common/sync.cuh"
#include "mla/output_layout.cuh"
#include "mla/params.cuh"
#include "mla/splitkv_softmax.cuh"
#include "mla/splitkv_traits.cuh"

namespace flashmla {

using namespace cute;

// Where this CTA's output goes for the current request.
struct OutputTarget {
    int batch_idx;
    int kv_head;
    int m_block;
    int num_rows;        // valid query rows in this m-block (<= 64)
    int split_idx;       // global split index, or -1 if the request was not split
    bool bad;            // a bad length or block id: out and lse are NaN
};

// Total softmax sum per row: reduce the quad, then add the two warpgroups' halves through
// shared memory. Returns the sums of this thread's two rows. Contains a __syncthreads.
template <typename T>
__device__ __forceinline__ void reduce_row_sums(RowState& rows, typename T::SharedStorage& st,
                                                int wg, int idx_in_wg, float (&total)[2]) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
        const float s = quad_sum(rows.sum[half]);
        if (idx_in_wg % 4 == 0) st.row_sum[wg][fragment_row(half, idx_in_wg)] = s;
    }
    consumer_sync<T>();
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
        const int row = fragment_row(half, idx_in_wg);
        total[half] = st.row_sum[0][row] + st.row_sum[1][row];
    }
}

// Row r's lse, written by thread r of the CTA (r < num_rows), after reduce_row_sums.
// 1 / sum of this thread's two rows (NaN for a bad request), times the attention sink's
// factor where the request is not split (the combine kernel applies it to split requests), and
// the dense FP8 cache's scale (V's, which is K's; an e4m3 q's P V also carries kE4m3PScale).
template <typename T>
__device__ __forceinline__ void output_factors(const SplitKVParams& p, typename T::SharedStorage& st,
                                               const OutputTarget& out, const float (&sums)[2],
                                               int idx_in_wg, float (&factor)[2]) {
    float v_scale = T::kCache == KVCache::kFp8 ? *p.kv_scale : 1.0f;
    if constexpr (T::kE4m3Q) v_scale /= kE4m3PScale;
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
        const float sum = sums[half];
        const bool empty = no_visible_token(sum);       // O = 0
        factor[half] = out.bad ? kNaN : empty ? 1.0f : v_scale / sum;
        if (T::kSparse && out.split_idx < 0 && !out.bad && !empty) {
            const int row = fragment_row(half, idx_in_wg);      // (sink_log2 is -inf past num_rows)
            factor[half] *= sink_factor_log2(st.sink_log2[row], log2f(sum) + st.row_max[row]);
        }
    }
}

template <typename T>
__device__ __forceinline__ void store_lse(const SplitKVParams& p, typename T::SharedStorage& st,
                                          const OutputTarget& out) {
    // Sparse: read here; made at the start, ptxas kept it through the page loop and spilled it.
    const int r = T::kSparse ? thread_index_here() : threadIdx.x;
    if (r >= out.num_rows) return;
    const float lse = row_lse(st.row_sum[0][r] + st.row_sum[1][r], st.row_max[r], out.bad, out.split_idx >= 0);
    const int q_row = out.m_block * kBlockM + r;
    if (out.split_idx < 0) {
        const int head = out.kv_head * p.heads_per_kv + q_row % p.heads_per_kv;
        const int token = q_row / p.heads_per_kv;
        p.lse[lse_index(out.batch_idx, head, token, p.h_q, p.s_q, p.sparse_s_q)] = lse;
    } else {
        // A NaN split makes the combined row NaN (combine_kernel.cu).
        p.lse_accum[((int64_t)out.split_idx * p.h_kv + out.kv_head) * p.q_rows + q_row] = lse;
    }
}

// Packs two floats into the two halves of a 32-bit word in the input precision.
template <typename Element>
__device__ __forceinline__ uint32_t pack_pair(float a, float b) {
    cutlass::Array<Element, 2> pair;
    pair[0] = Element(a);
    pair[1] = Element(b);
    return reinterpret_cast<uint32_t const&>(pair);
}

// A 4x4 transpose of 32-bit words across the four threads of a quad: thread t's word s becomes
// thread s's word t. Two rounds of pairwise swaps (lanes t ^ 1, then t ^ 2), each exchanging the
// words whose index differs from the lane in that bit.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int lane) {
    CUTE_UNROLL
    for (int bit = 1; bit <= 2; bit *= 2) {
        const bool high = lane & bit;
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
            if (j & bit) continue;                       // pairs (j, j + bit)
            const uint32_t recv = __shfl_xor_sync(0xffffffffu, high ? w[j] : w[j + bit], bit);
            if (high) {
                w[j] = recv;
            } else {
                w[j + bit] = recv;
            }
        }
    }
}

// O / sum from registers straight to global memory. The final output: the quad's threads hold
// two columns of each n8 tile of a row; quad_transpose over four neighbouring tiles gives each
// one whole tile's eight columns, stored in 16 bytes, so that a warp's store writes 64 contiguous
// bytes of each of its eight rows (with 4-byte stores, 16: four times the store instructions
// and L1 requests; 1-2 % of the time of the h_q * s_q >= 64 rows at s_k 4096,
// docs/perf-notes.md section 50). The sparse values warpgroup (kRole 1) and the FP8 cache's
// one-token pages with a bf16 q have no registers for the transposes (ptxas spills 40 and 8 B):
// 4-byte stores there.
// Split outputs (fp32) keep 8 bytes a thread: each quad writes 32 contiguous bytes of a row, and
// L2 merges the quads' pieces of a sector. The output is tiny next to the pages read, and
// without shared-memory staging the next request's Q and first pages can be loading while this
// runs.
template <typename T, int kRole>
constexpr bool kWideOutStores = !T::kExpanderStages && (!T::kSparse || kRole == 0);

template <typename T, int kRole, typename FragO>
__device__ __forceinline__ void store_o(const SplitKVParams& p, FragO const& o, const float (&inv_sum)[2],
                                        const OutputTarget& out, int wg, int idx_in_wg) {
    using Element = typename T::IoElement;
    const int col0 = wg * (kHeadDimV / 2) + fragment_col(0, idx_in_wg);
    const int quad_lane = idx_in_wg % 4;
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
        const int row = fragment_row(half, idx_in_wg);
        const bool inside = row < out.num_rows;          // the transposes need the whole quad: no early exit
        const int64_t q_row = out.m_block * kBlockM + row;
        const float inv = inv_sum[half];
        if (out.split_idx < 0 && !kWideOutStores<T, kRole>) {
            Element* dst = static_cast<Element*>(p.o) +
                (((int64_t)out.batch_idx * p.q_rows + q_row) * p.h_kv + out.kv_head) * kHeadDimV + col0;
            CUTE_UNROLL
            for (int i = half * 2; inside && i < size(o); i += 4) {
                *reinterpret_cast<uint32_t*>(dst + (i / 4) * 8) = pack_pair<Element>(o(i) * inv, o(i + 1) * inv);
            }
        } else if (out.split_idx < 0) {
            // The quad's tile 4k + quad_lane: columns from wg's first plus 8 (4k + quad_lane).
            Element* dst = static_cast<Element*>(p.o) +
                (((int64_t)out.batch_idx * p.q_rows + q_row) * p.h_kv + out.kv_head) * kHeadDimV +
                wg * (kHeadDimV / 2) + quad_lane * 8;
            CUTE_UNROLL
            for (int k = 0; k < size(o) / 16; ++k) {
                uint32_t w[4];
                CUTE_UNROLL
                for (int j = 0; j < 4; ++j) {
                    const int i = half * 2 + (4 * k + j) * 4;
                    w[j] = pack_pair<Element>(o(i) * inv, o(i + 1) * inv);
                }
                quad_transpose(w, quad_lane);
                static_assert(sizeof(uint4) == kOutStoreBytes, "the host checks out's alignment for these stores");
                if (inside) *reinterpret_cast<uint4*>(dst + k * 32) = make_uint4(w[0], w[1], w[2], w[3]);
            }
        } else if (inside) {
            float* dst = p.o_accum +
                (((int64_t)out.split_idx * p.h_kv + out.kv_head) * p.q_rows + q_row) * kHeadDimV + col0;
            CUTE_UNROLL
            for (int i = half * 2; i < size(o); i += 4) {
                *reinterpret_cast<float2*>(dst + (i / 4) * 8) = make_float2(o(i) * inv, o(i + 1) * inv);
            }
        }
    }
}

}  // namespace flashmla
