// Sparse decoding's two consumer warpgroups (after FlashMLA's sparse decoding kernel): one for
// the scores and the left half of O, one for the right half of O, instead of the seesaw.
//
// Per page (page buffer b = page parity within the request):
//   scores warpgroup (0): S = Q K^T tile by tile as the producers fill them, the skipped tokens
//     masked, online softmax with the running max in registers; P -> p0 and the rows' rescale
//     factors -> scale0; O_L = O_L * factor + P V_L.
//   values warpgroup (1): O_R = O_R * factor + P V_R, with P from p0.
// Each releases the tiles it reads last (bar_free, to every producer of the cluster: the scores
// warpgroup tiles 0-3 after P V_L, the values warpgroup tiles 4-8 after P V_R) once its WGMMAs
// have read them. Why not the seesaw: two warpgroups that each hold S and half of O leave the
// producer 40 registers, too few for a half page of gathered tokens in flight (the dense FP8
// cache's expander needs no more: TMA loads its bytes); warpgroup 1 needs no S here, so the split
// is 224 / 160 / 120 in pairs and 208 / 160 / 136 for CTAs alone (splitkv_traits.cuh).
#pragma once
#include <cute/tensor.hpp>

#include "common/sync.cuh"
#include "mla/splitkv_gemm.cuh"
#include "mla/splitkv_softmax.cuh"
#include "mla/splitkv_traits.cuh"

namespace flashmla {

using namespace cute;

// Page buffer `buf`'s tile group kGroup (warpgroup kGroup's last reads) may be refilled as far as
// this warpgroup is concerned (one thread calls).
template <typename T, int kGroup>
__device__ __forceinline__ void release_tiles(typename T::SharedStorage& st, int buf) {
    const uint32_t bar = smem_u32(&st.bar_free[T::free_barrier(kGroup, buf)]);
    mbarrier_arrive(bar);
    if (cluster_size() == 2) mbarrier_arrive_peer(peer_address(bar, cluster_rank() ^ 1));
}

// Scores warpgroup over pages [first_page, end_page) of a request: O_L, the row sums and the
// running max (log2 domain) accumulate. `kv_phase` bit b: parity of page buffer b's next fill.
template <typename T, typename FragO>
__device__ __forceinline__ void fp8_scores_pages(typename T::SharedStorage& st, float scale_log2,
                                                    int first_page, int end_page, FragO& o, RowState& rows,
                                                    float (&row_max)[2], uint32_t& kv_phase, int idx) {
    Tensor s = partition_fragment_C(typename T::MmaQK{}, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor pb = make_tensor<typename T::Element>(typename T::LayoutFragA{});
    // Q's RoPE tile as the register operand of tile 8's WGMMAs, loaded once a request: with both
    // operands in shared memory, a 64 x 64 x 16 step reads 4 KB, all that shared memory gives in
    // its time, while the producer's stores compete (docs/perf-notes.md section 55).
    using Rope = typename T::RopeElement;
    Tensor q8 = make_tensor<Rope>(typename T::LayoutFragA{});
    load_a_tile<T, Rope>(computed_here(reinterpret_cast<Rope*>(st.q + (kTilesK - 1) * 64 * kTileCols)), q8, idx);
    // In pairs Q's tile 0 as well (SplitKVTraits::kScoresRegs).
    auto q0 = [&] {
        if constexpr (T::kPairs) {
            Tensor q = make_tensor<typename T::Element>(typename T::LayoutFragA{});
            load_a_tile<T, typename T::Element>(computed_here(st.q), q, idx);
            return q;
        } else {
            return QTile0InSmem{};
        }
    }();
    #pragma unroll 1
    for (int page = first_page; page < end_page; ++page) {
        const int buf = (page - first_page) & 1;
        qk_tiles<T, 0, kTilesK, true>(st.q, st.kv[buf], smem_u32(&st.bar_kv[buf][0]), (kv_phase >> buf) & 1,
                                      q8, s, idx, q0);
        kv_phase ^= 1u << buf;
        warpgroup_wait<0>();
        if (page > first_page) named_barrier_sync(int(WgBarrier::kPFree), 256);   // p0, scale0 read
        const uint64_t valid = *reinterpret_cast<const uint64_t*>(st.token_valid[buf]);
        const int first_token = page * kBlockN;
        float factor[2];
        CUTE_UNROLL
        for (int half = 0; half < 2; ++half) {
            const float page_max = masked_row_max<false, true>(s, half, first_token, rows.right_border[half], valid,
                                                               scale_log2, idx);
            const float m_new = lazy_row_max<false>(row_max[half], page_max);
            factor[half] = exp2_approx(row_max[half] - m_new);
            row_max[half] = m_new;
            rows.sum[half] = rows.sum[half] * factor[half] + exponentiate(s, pb, half, m_new, scale_log2);
            if (idx % 4 == 0) st.scale0[fragment_row(half, idx)] = factor[half];
        }
        scale_rows(o, factor);
        store_p<T>(pb, computed_here(st.p0), idx);             // addresses made here (kept, they spilled)
        fence_smem_for_async_proxy();
        named_barrier_arrive(int(WgBarrier::kPReady), 256);
        pv_reg_p<T, 0>(pb, st.kv[buf], o, idx);                  // O_L += P V_L
        warpgroup_wait<0>();
        if (idx == 0) release_tiles<T, 0>(st, buf);   // tiles 0-3
    }
}

// Values warpgroup over the same pages: O_R follows the scores warpgroup's factors.
template <typename T, typename FragO>
__device__ __forceinline__ void fp8_values_pages(typename T::SharedStorage& st, int first_page, int end_page,
                                                    FragO& o, int idx) {
    #pragma unroll 1
    for (int page = first_page; page < end_page; ++page) {
        const int buf = (page - first_page) & 1;
        named_barrier_sync(int(WgBarrier::kPReady), 256);
        const float factor[2] = {st.scale0[fragment_row(0, idx)], st.scale0[fragment_row(1, idx)]};
        scale_rows(o, factor);
        pv_smem_p<T, 1>(st.p0, st.kv[buf], o, idx);             // O_R += P V_R
        warpgroup_wait<0>();
        if (idx == 0) release_tiles<T, 1>(st, buf);   // tiles 4-8
        if (page + 1 < end_page) named_barrier_arrive(int(WgBarrier::kPFree), 256);
    }
}

}  // namespace flashmla
