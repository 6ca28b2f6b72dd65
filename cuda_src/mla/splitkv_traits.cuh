// Types of the split-KV kernel: WGMMA shapes, shared-memory layouts and the shared-memory plan.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "common/sync.cuh"
#include "mla/config.cuh"

namespace flashmla {

using namespace cute;

// kSparse: DeepSeek-V3.2's sparse decoding over the FP8 cache. A third warpgroup gathers the
// tokens that `indices` names and dequantizes them into the page buffers; the NoPE part (Q's
// first 512 columns, K, V, P) is then fp16 — e4m3 values and their power-of-two scales are
// exact in it, and e4m3 -> fp16 is one instruction per pair — while the RoPE tile stays bf16.
// Its consumers are not the seesaw (sparse_consumers.cuh).
template <typename Element_, bool kSparse_ = false>
struct SplitKVTraits {
    using Element = Element_;                  // Q, K, V, P (the NoPE part, for kSparse)
    static constexpr bool kSparse = kSparse_;
    // The caller's precision: O, and the RoPE tile (8) of Q and K (bf16 in the sparse cache).
    using IoElement = cuda::std::conditional_t<kSparse, cutlass::bfloat16_t, Element>;
    static_assert(cuda::std::is_same_v<Element, cutlass::bfloat16_t> ||
                  cuda::std::is_same_v<Element, cutlass::half_t>, "bf16 or fp16");
    static_assert(!kSparse || cuda::std::is_same_v<Element, cutlass::half_t>, "sparse: fp16 NoPE");

    // Two consumer warpgroups, each owning half of O's columns (+ the sparse producer).
    static constexpr int kConsumerThreads = kSplitKVThreads;
    static constexpr int kThreads = kConsumerThreads + (kSparse ? kSparseProducerThreads : 0);
    static_assert(kConsumerThreads == 256, "two consumer warpgroups");
    static_assert(!kSparse || kSparseProducerThreads == 128, "one producer warpgroup");
    // Sparse: registers per thread after the split (setmaxnreg) of the pool that __launch_bounds__
    // gives (384 x 168): the scores warpgroup holds S, P and O_L, the values warpgroup only O_R,
    // and the producer a half page's loads per round in flight.
    static constexpr int kScoresRegs = 192;
    static constexpr int kValuesRegs = 160;
    static constexpr int kProducerRegs = 152;
    static_assert(!kSparse || kScoresRegs + kValuesRegs + kProducerRegs == 3 * 168, "the register pool");

    using BlockM = Int<kBlockM>;
    using Page = Int<kBlockN>;
    using DimK = Int<kHeadDimK>;
    using HalfV = Int<kHeadDimV / 2>;

    // S = Q K^T for one page: 64 x 64, K = 576. Q from shared memory, or (its last 64 columns)
    // from registers: that tile of sQ is reused as the buffer of warpgroup 1's P.
    using MmaQK = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<BlockM, Page, DimK>,
                             GMMA::Major::K, GMMA::Major::K>()));
    using MmaQKRegQ = decltype(make_tiled_mma(
        GMMA::rs_op_selector<IoElement, IoElement, float, Shape<BlockM, Page, DimK>,
                             GMMA::Major::K, GMMA::Major::K>()));
    using MmaQKRope = decltype(make_tiled_mma(       // sparse: the RoPE tile of Q from shared memory
        GMMA::ss_op_selector<IoElement, IoElement, float, Shape<BlockM, Page, DimK>,
                             GMMA::Major::K, GMMA::Major::K>()));
    // O_half += P V_half: 64 x 256, K = 64 tokens. P from registers (own page) or from shared
    // memory (the other warpgroup's page); V is the cache tile read MN-major.
    using MmaPVRegP = decltype(make_tiled_mma(
        GMMA::rs_op_selector<Element, Element, float, Shape<BlockM, HalfV, Page>,
                             GMMA::Major::K, GMMA::Major::MN>()));
    using MmaPVSmemP = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<BlockM, HalfV, Page>,
                             GMMA::Major::K, GMMA::Major::MN>()));

    // A 64 x 64 tile with 128-byte swizzle: exactly what one TMA box writes.
    using SmemLayoutTile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                  Shape<Int<64>, Int<kTileCols>>{}));
    // 64 rows x 576 columns = 9 such tiles back to back (Q, and each K page).
    using SmemLayoutRows = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                  Shape<Int<64>, DimK>{}));
    // The same page seen as V^T: (512 columns, 64 tokens).
    using SmemLayoutV = decltype(composition(
        SmemLayoutRows{}, make_layout(Shape<Int<kHeadDimV>, Page>{}, GenRowMajor{})));

    // Register fragments: S/P as accumulator (64 x 64), O half (64 x 256), and P or Q's last
    // tile as a 64 x 64 A operand in registers.
    using FragS = decltype(partition_fragment_C(MmaQK{}, Shape<BlockM, Page>{}));
    using FragO = decltype(partition_fragment_C(MmaPVRegP{}, Shape<BlockM, HalfV>{}));
    using LayoutFragA = Layout<Shape<Shape<_2, _2, _2>, _1, _4>, Stride<Stride<_1, _2, _4>, _0, _8>>;

    struct alignas(1024) SharedStorage {
        // 128-byte-swizzled buffers must start on 1024-byte boundaries.
        alignas(1024) Element q[cosize_v<SmemLayoutRows>];       // tile 8 doubles as P1 (dense)
        alignas(1024) Element kv[2][cosize_v<SmemLayoutRows>];   // page 2i in kv[0], 2i+1 in kv[1]
        alignas(1024) Element p0[cosize_v<SmemLayoutTile>];      // warpgroup 0's P, for warpgroup 1
        float row_max[kBlockM];          // running max (log2 domain), shared by both warpgroups
        float scale0[kBlockM];           // rescale factor computed by warpgroup 0 this step (page)
        float scale1[kBlockM];           // ... by warpgroup 1
        float row_sum[2][kBlockM];       // per-warpgroup softmax denominators, for the epilogue
        int bad_request[2];              // per request parity: a bad block id was seen (NaN output)
        uint8_t token_valid[2][8];       // sparse: per page buffer, bit t = token t is attended
        uint64_t bar_kv[2][kTilesK];     // one barrier per 64-column tile of each page buffer (full)
        uint64_t bar_free[2];            // sparse: a page buffer may be refilled
        uint64_t bar_q;
    };
    static_assert(sizeof(SharedStorage) <= 227 * 1024, "shared memory plan exceeds the 227 KB per block");
#ifndef FLASHMLA_SPLITKV_SMEM_BYTES
#error "compile through flashmla_cupy (it defines the host-side shared-memory size)"
#endif
    static_assert(sizeof(SharedStorage) == FLASHMLA_SPLITKV_SMEM_BYTES, "host and device shared-memory sizes differ");
};

// Named barriers between the two warpgroups (0 is __syncthreads).
enum class WgBarrier : int {
    kScale0Ready = 1,     // warpgroup 0 published row_max / scale0 for this page pair
    kScale1Ready = 2,     // warpgroup 1 published scale1
    kP0Ready = 3,         // warpgroup 0 stored its rescaled P into p0
    kP1Issued = 4,        // warpgroup 1 stored P1 and issued its WGMMAs reading p0
    kRowMaxInit = 5,      // row_max initialized (warpgroup 0 only)
    kPReady = 1,          // sparse: warpgroup 0 stored P and its rescale factors (p0, scale0)
    kPFree = 2,           // sparse: warpgroup 1's WGMMA has read p0
    kConsumers = 8,       // both consumer warpgroups (the sparse kernel's __syncthreads)
};

// __syncthreads of the consumer warpgroups (the sparse producer warpgroup does not take part).
template <typename T>
__device__ __forceinline__ void consumer_sync() {
    if constexpr (T::kSparse) {
        named_barrier_sync(int(WgBarrier::kConsumers), T::kConsumerThreads);
    } else {
        __syncthreads();
    }
}

}  // namespace flashmla
