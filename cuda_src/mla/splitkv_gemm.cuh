// Warpgroup GEMMs of the split-KV kernel: S = Q K^T tile by tile as TMA delivers K, and
// O_half += P V_half with P in registers or in shared memory; plus moving P between the two.
//
// All WGMMAs are issued asynchronously: each function commits one or more batches and returns;
// the caller waits with warpgroup_wait<N>() where the schedule needs the results.
#pragma once
#include <cute/tensor.hpp>

#include "common/sync.cuh"
#include "mla/fp8_staged.cuh"
#include "mla/splitkv_softmax.cuh"
#include "mla/splitkv_traits.cuh"

namespace flashmla {

using namespace cute;

template <typename T>
__device__ __forceinline__ auto smem_rows(typename T::Element* base) {       // (64, 576)
    return make_tensor(make_smem_ptr(base), typename T::SmemLayoutRows{});
}

template <typename T, typename E = typename T::Element>
__device__ __forceinline__ auto smem_tile(E* base) {                        // (64, 64)
    return make_tensor(make_smem_ptr(base), typename T::SmemLayoutTile{});   // same swizzle for any 16-bit E
}

// Columns [256*kHalf, 256*kHalf + 256) of V = the page buffer read as V^T: (256, 64 tokens).
// An e4m3 q: `page` is the expander's e4m3 V^T buffer of the page (fp8_staged.cuh).
template <typename T, int kHalf>
__device__ __forceinline__ auto smem_v_half(typename T::Element* page) {
    if constexpr (T::kE4m3Q) {
        auto vt = reinterpret_cast<cutlass::float_e4m3_t*>(page) + kHalf * kTransposedVHalfBytes;
        return make_tensor(make_smem_ptr(vt), typename T::SmemLayoutVtHalf{});
    } else {
        auto v = make_tensor(make_smem_ptr(page), typename T::SmemLayoutV{});
        return local_tile(v, Shape<Int<kHeadDimV / 2>, Int<kBlockN>>{}, make_coord(Int<kHalf>{}, _0{}));
    }
}

// A P buffer (p0, or warpgroup 1's in sQ) as P V's A operand: 64 x 64 of Element, or of e4m3.
template <typename T>
__device__ __forceinline__ auto smem_p_tile(typename T::Element* sp) {
    if constexpr (T::kE4m3Q) {
        return make_tensor(make_smem_ptr(reinterpret_cast<cutlass::float_e4m3_t*>(sp)), typename T::SmemLayoutPE4m3{});
    } else {
        return smem_tile<T>(sp);
    }
}

// Issue C (+)= A B over the first `k_blocks` K-blocks of the fragments (-1: all) as one WGMMA
// batch (arrive ... commit).
template <typename Mma, typename FragA, typename FragB, typename FragC>
__device__ __forceinline__ void wgmma_batch(Mma& mma, FragA const& a, FragB const& b, FragC& c,
                                            bool zero_init, int k_blocks = -1) {
    constexpr bool kRegA = !cute::is_base_of<GMMA::DescriptorIterator, typename Mma::FrgTypeA>::value;
    if constexpr (kRegA) warpgroup_fence_operand(const_cast<FragA&>(a));
    warpgroup_fence_operand(c);
    warpgroup_arrive();
    mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a); ++k) {
        if (k == k_blocks) break;
        cute::gemm(mma, a(_, _, k), b(_, _, k), c);
        mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(c);
    if constexpr (kRegA) warpgroup_fence_operand(const_cast<FragA&>(a));
}

// qk_tiles takes tile 8 of Q (RoPE) in registers: the 16-bit kernel reuses that part of sQ for
// warpgroup 1's P, and the sparse kernel's QK^T reads less shared memory so (docs/perf-notes.md
// section 55). This marker stands for it where Q stays staged in sQ (an e4m3 q: qk_staged).
struct RopeTileInSmem {};

// S (+)= Q K^T over the page's 64-column tiles kFirst, kFirst+1, ... (kCount of them, wrapping
// mod 9; counted from tile 8 down where T::kQkFromLastTile), each issued as soon as its barrier
// completes (one batch per tile). 16-bit cache: the
// consumer announces TMA's bytes; FP8 caches: the producers fill the tiles. `q_tile8`: Q's tile 8
// in registers; `q_tile0`: Q's tile 0 in registers too (the sparse pairs' scores warpgroup), or
// QTile0InSmem. `kFresh`: the first tile overwrites S instead of accumulating.
struct QTile0InSmem {};
template <typename T, int kFirst, int kCount, bool kFresh, typename FragQ8, typename FragS, typename FragQ0 = QTile0InSmem>
__device__ __forceinline__ void qk_tiles(typename T::Element* sq, typename T::Element* page,
                                         uint32_t bar_page, uint32_t phase,
                                         FragQ8 const& q_tile8, FragS& s, int idx_in_wg, FragQ0 const& q_tile0 = {}) {
    constexpr bool kRegTile0 = !cute::is_same_v<FragQ0, QTile0InSmem>;
    constexpr int kTileElems = 64 * kTileCols;
    using Rope = typename T::RopeElement;                  // bf16 in the sparse kernel
    typename T::MmaQK mma;
    CUTE_UNROLL
    for (int i = 0; i < kCount; ++i) {
        const int tile = T::kQkFromLastTile ? kTilesK - 1 - (kFirst + i) % kTilesK : (kFirst + i) % kTilesK;
        const uint32_t bar = bar_page + T::kv_barrier(tile) * sizeof(uint64_t);
        if (!T::kProducer && idx_in_wg == 0) mbarrier_arrive_expect_tx(bar, kTileElems * sizeof(typename T::Element));
        const int previous = T::kQkFromLastTile ? tile + 1 : tile - 1;
        if (i == 0 || T::kv_barrier(previous) != T::kv_barrier(tile)) {
            mbarrier_wait(bar, phase);
        } else if constexpr (T::kGroupBarriers) {
            // no wait before this tile: its descriptors made here all the same (hoisted across
            // the group, NVRTC 13.5 spilled 16 B)
            page = computed_here(page);
            sq = computed_here(sq);
        }
        auto k_tile = smem_tile<T>(page + tile * kTileElems);
        if (tile == kTilesK - 1) {
            auto rope_k = smem_tile<T>(reinterpret_cast<Rope*>(page + tile * kTileElems));
            typename T::MmaQKRegQ mma_reg_q;
            auto frag_k = mma_reg_q.get_slice(idx_in_wg).partition_fragment_B(rope_k);
            wgmma_batch(mma_reg_q, q_tile8, frag_k, s, kFresh && i == 0);
        } else if (kRegTile0 && tile == 0) {
            if constexpr (kRegTile0) {                     // (q_tile0 is a fragment only then)
                typename T::MmaQKRegQNoPE mma_reg_q;
                auto frag_k = mma_reg_q.get_slice(idx_in_wg).partition_fragment_B(k_tile);
                wgmma_batch(mma_reg_q, q_tile0, frag_k, s, kFresh && i == 0);
            }
        } else {
            auto thr = mma.get_slice(idx_in_wg);
            wgmma_batch(mma, thr.partition_fragment_A(smem_tile<T>(sq + tile * kTileElems)),
                        thr.partition_fragment_B(k_tile), s, kFresh && i == 0);
        }
    }
}

// An e4m3 q: S (+)= Q K^T over the staged boxes kFirst .. kFirst + kCount - 1 of Q (`sq`) and of
// the page (fp8_staged.cuh) once its bytes are in (`bar_staged`), one FP8 WGMMA batch per box;
// box 4 (RoPE) takes only the k-steps of its 64 values, the rest being zero fill.
template <typename T, int kFirst, int kCount, bool kFresh, typename FragS>
__device__ __forceinline__ void qk_staged(const void* sq, const void* page, uint32_t bar_staged,
                                          uint32_t phase, FragS& s, int idx_in_wg) {
    using E4m3 = cutlass::float_e4m3_t;
    mbarrier_wait(bar_staged, phase);
    typename T::MmaQKE4m3 mma;
    auto thr = mma.get_slice(idx_in_wg);
    // The descriptors of all 18 k-steps of a page are loop-invariant: kept from one page to the
    // next, they spilled (88 B).
    const E4m3* q = computed_here(static_cast<const E4m3*>(sq));
    const E4m3* k = computed_here(static_cast<const E4m3*>(page));
    CUTE_UNROLL
    for (int i = 0; i < kCount; ++i) {
        const int box = kFirst + i;
        auto q_box = make_tensor(make_smem_ptr(q + box * kStagedBoxBytes), typename T::SmemLayoutStagedBox{});
        auto k_box = make_tensor(make_smem_ptr(k + staged_box_offset(box)),
                                 typename T::SmemLayoutStagedBox{});
        auto frag_q = thr.partition_fragment_A(q_box);
        const int values = min(kFp8StagedRowBytes, kHeadDimK - box * kFp8StagedRowBytes);
        wgmma_batch(mma, frag_q, thr.partition_fragment_B(k_box), s, kFresh && i == 0,
                    size<2>(frag_q) * values / kFp8StagedRowBytes);
    }
}

// S = Q K^T over the whole page at once, after all nine tiles arrived (first page of a request).
// FP8 caches: the descriptors computed here (computed_here), not kept from the prologue (at 224
// registers NVRTC 13.5 spilled one).
template <typename T, typename FragS>
__device__ __forceinline__ void qk_full_page(typename T::Element* sq, typename T::Element* page,
                                             uint32_t bar_page, uint32_t phase, FragS& s,
                                             int idx_in_wg) {
    CUTE_UNROLL
    for (int tile = 0; tile < kTilesK; ++tile) {
        const uint32_t bar = bar_page + tile * sizeof(uint64_t);
        if (!T::kProducer && idx_in_wg == 0) mbarrier_arrive_expect_tx(bar, 64 * kTileCols * sizeof(typename T::Element));
        mbarrier_wait(bar, phase);
    }
    typename T::MmaQK mma;
    auto thr = mma.get_slice(idx_in_wg);
    if constexpr (T::kProducer) {
        sq = computed_here(sq);
        page = computed_here(page);
    }
    wgmma_batch(mma, thr.partition_fragment_A(smem_rows<T>(sq)), thr.partition_fragment_B(smem_rows<T>(page)),
                s, true);
}

// O_half += P V_half with P (64 x 64, this warpgroup's page) in registers.
template <typename T, int kHalf, typename FragP, typename FragO>
__device__ __forceinline__ void pv_reg_p(FragP const& p, typename T::Element* page, FragO& o,
                                         int idx_in_wg) {
    typename T::MmaPVRegP mma;
    auto frag_v = mma.get_slice(idx_in_wg).partition_fragment_B(smem_v_half<T, kHalf>(page));
    wgmma_batch(mma, p, frag_v, o, false);
}

// O_half += P V_half with P in shared memory (the other warpgroup's page).
template <typename T, int kHalf, typename FragO>
__device__ __forceinline__ void pv_smem_p(typename T::Element* sp, typename T::Element* page,
                                          FragO& o, int idx_in_wg) {
    typename T::MmaPVSmemP mma;
    auto thr = mma.get_slice(idx_in_wg);
    wgmma_batch(mma, thr.partition_fragment_A(smem_p_tile<T>(sp)),
                thr.partition_fragment_B(smem_v_half<T, kHalf>(page)), o, false);
}

// P (accumulator layout, converted to Element) -> shared memory tile, with stmatrix. An e4m3 P:
// each register (p_to_e4m3) is four bytes of one row of the 64-byte-swizzled tile, in k order;
// the eight rows of a warp's store fall in eight different 16-byte slots of the banks.
template <typename T, typename FragP>
__device__ __forceinline__ void store_p(FragP const& p, typename T::Element* sp, int idx_in_wg) {
    if constexpr (T::kE4m3Q) {
        auto words = recast<uint32_t>(p);
        const uint32_t base = smem_u32(sp);
        CUTE_UNROLL
        for (int r = 0; r < 8; ++r) {
            const int row = fragment_row(r % 2, idx_in_wg);
            const int k = 32 * (r / 4) + 16 * ((r / 2) % 2) + 4 * (idx_in_wg % 4);
            store_shared_u32(base + sw64_offset(row, k), words(r));
        }
    } else {
        auto copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, typename T::Element>{},
                                      typename T::MmaQK{});
        auto thr = copy.get_slice(idx_in_wg);
        cute::copy(copy, thr.retile_S(p), thr.partition_D(smem_tile<T>(sp)));
    }
}

// A 64 x 64 shared-memory tile of E -> registers in the WGMMA A-operand layout, with ldmatrix.
template <typename T, typename E, typename FragA>
__device__ __forceinline__ void load_a_tile(E* tile, FragA& a, int idx_in_wg) {
    auto copy = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, E>{}, typename T::MmaPVRegP{});
    auto thr = copy.get_slice(idx_in_wg);
    cute::copy(copy, thr.partition_S(smem_tile<T>(tile)), thr.retile_D(a));
}

}  // namespace flashmla
