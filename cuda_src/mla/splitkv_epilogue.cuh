// Epilogue of one (request, split): normalize O by the softmax sum and write it out.
//
// * The request was not split: O in the input precision, staged in shared memory as eight
//   swizzled 64 x 64 tiles and written by TMA (rows past the query count are clipped by the
//   tensor map); lse (natural log) straight into [batch][h_q][s_q].
// * Otherwise: fp32 O rows and the log2-domain lse into the split workspace, for the combine
//   kernel.
// Shared-memory staging reuses the page buffers, which are idle by now.
#pragma once
#include <cute/tensor.hpp>

#include "common/sync.cuh"
#include "common/tma.cuh"
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
    __syncthreads();
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
        const int row = fragment_row(half, idx_in_wg);
        total[half] = st.row_sum[0][row] + st.row_sum[1][row];
    }
}

// Row r's lse, written by thread r of the CTA (r < num_rows), after reduce_row_sums.
template <typename T>
__device__ __forceinline__ void store_lse(const SplitKVParams& p, typename T::SharedStorage& st,
                                          const OutputTarget& out) {
    const int r = threadIdx.x;
    if (r >= out.num_rows) return;
    const float sum = st.row_sum[0][r] + st.row_sum[1][r];
    const bool empty = sum == 0.0f || sum != sum;      // no visible token (or NaN): see kernel
    const int q_row = out.m_block * kBlockM + r;
    if (out.split_idx < 0) {
        const int head = out.kv_head * p.heads_per_kv + q_row % p.heads_per_kv;
        const int token = q_row / p.heads_per_kv;
        p.lse[((int64_t)out.batch_idx * p.h_q + head) * p.s_q + token] =
            empty ? kInf : logf(sum) + st.row_max[r] * kLn2;
    } else {
        p.lse_accum[((int64_t)out.split_idx * p.h_kv + out.kv_head) * p.q_rows + q_row] =
            empty ? -kInf : log2f(sum) + st.row_max[r];
    }
}

// O / sum -> Element -> swizzled smem tiles (warpgroup wg: tiles 4wg .. 4wg+3) -> TMA store.
template <typename T, typename FragO>
__device__ __forceinline__ void store_o_final(const SplitKVParams& p, typename T::SharedStorage& st,
                                              FragO const& o, const float (&inv_sum)[2],
                                              const OutputTarget& out, int wg, int idx_in_wg) {
    using Element = typename T::Element;
    Tensor o_cast = make_tensor_like<Element>(o);
    CUTE_UNROLL
    for (int i = 0; i < size(o); ++i) o_cast(i) = Element(o(i) * inv_sum[(i / 2) % 2]);

    Element* staging = st.kv[0];
    auto s_out = make_tensor(make_smem_ptr(staging),
                             tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                           Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
    auto s_half = local_tile(s_out, Shape<Int<kBlockM>, Int<kHeadDimV / 2>>{}, make_coord(_0{}, wg));
    auto copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, typename T::MmaPVRegP{});
    auto thr = copy.get_slice(idx_in_wg);
    cute::copy(copy, thr.retile_S(o_cast), thr.partition_D(s_half));
    fence_smem_for_async_proxy();
    named_barrier_sync(6 + wg, 128);   // this warpgroup's tiles are complete

    if (idx_in_wg == 0) {
        constexpr int kTileElems = kBlockM * kTileCols;
        CUTE_UNROLL
        for (int t = 0; t < kTilesV / 2; ++t) {
            const int tile = wg * (kTilesV / 2) + t;
            tma_store_4d(&p.tma_o, smem_u32(staging + tile * kTileElems), tile * kTileCols,
                         out.m_block * kBlockM, out.kv_head, out.batch_idx);
        }
        bulk_commit();
        bulk_wait_smem_reads();
    }
}

// O / sum in fp32 -> padded smem rows -> one bulk copy per valid row into o_accum.
template <typename T, typename FragO>
__device__ __forceinline__ void store_o_split(const SplitKVParams& p, typename T::SharedStorage& st,
                                              FragO const& o, const float (&inv_sum)[2],
                                              const OutputTarget& out, int wg, int idx_in_wg) {
    constexpr int kStride = kHeadDimV + 8;             // pad rows: no bank conflicts
    float* staging = reinterpret_cast<float*>(&st.kv[0][0]);
    CUTE_UNROLL
    for (int i = 0; i < size(o); i += 2) {
        const int row = fragment_row((i / 2) % 2, idx_in_wg);
        const int col = wg * (kHeadDimV / 2) + fragment_col(i, idx_in_wg);
        const float inv = inv_sum[(i / 2) % 2];
        *reinterpret_cast<float2*>(staging + row * kStride + col) = make_float2(o(i) * inv, o(i + 1) * inv);
    }
    fence_smem_for_async_proxy();
    __syncthreads();
    const int r = threadIdx.x;
    if (r < out.num_rows) {
        float* dst = p.o_accum +
            (((int64_t)out.split_idx * p.h_kv + out.kv_head) * p.q_rows + out.m_block * kBlockM + r) * kHeadDimV;
        bulk_store(dst, smem_u32(staging + r * kStride), kHeadDimV * sizeof(float));
        bulk_commit();
        bulk_wait_smem_reads();
    }
}

}  // namespace flashmla
