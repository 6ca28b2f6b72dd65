// Types of the split-KV kernel: WGMMA shapes, shared-memory layouts and the shared-memory plan.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "common/sync.cuh"
#include "mla/config.cuh"
#include "mla/fp8_staged.cuh"

namespace flashmla {

using namespace cute;

// What fills the page buffers, and so which form of the kernel runs.
enum class KVCache : int {
    k16Bit = 0,       // the cache in q's dtype (bf16 / fp16), loaded by TMA; the seesaw consumers
    kFp8Sparse = 1,   // DeepSeek-V3.2's 656-byte FP8 tokens, named by `indices` (sparse decoding)
    kFp8 = 2,         // e4m3 tokens of 576 values with one scale per tensor, by block table; the
                      // seesaw consumers, a warpgroup expanding the pages that TMA staged (fp8_expand.cuh)
};

// The FP8 caches (kProducer): a third warpgroup fills the page buffers with fp16 values: the
// sparse cache's gathers and dequantizes its tokens (fp8_producer.cuh) for consumers that are not
// the seesaw (fp8_consumers.cuh); the dense FP8 cache's expands pages that the consumers' TMA
// loads staged in the page buffers themselves (fp8_expand.cuh) for the seesaw. Q,
// K, V and P are fp16 there (Q converted in place; e4m3 values, and the sparse cache's
// power-of-two scales, are exact in fp16, and e4m3 -> fp16 is one instruction per pair), and O is
// bf16. The sparse cache keeps its RoPE part in bf16, so that tile of Q stays bf16; the dense
// FP8 cache's RoPE part is e4m3 like the rest. Its scale multiplies the scores and O instead of
// every value.
// kE4m3Q_ (dense FP8 cache only): q holds e4m3 values; QK^T is an FP8 WGMMA on Q's and each
// page's staged bytes (fp8_staged.cuh), and P V one on V^T, which the third warpgroup writes in
// e4m3 into a ring of three V^T buffers, with P rounded to e4m3.
// kTokenPages_: the form for one-token pages of a dense cache, which copies the tokens with
// cp.async where TMA would take a box per token (SplitKVCta::load_token_tiles,
// copy_staged_tokens); a program of its own, since that path inside the other form cost the other
// page sizes 0.5 % (docs/perf-notes.md section 40).
// kPairs_ (sparse cache only): the form for pairs of CTAs, the two of a cluster (two m-blocks,
// h_q 128) sharing each page, each dequantizing half of it (fp8_producer.cuh); false: the form
// for a CTA that dequantizes its pages alone (one m-block). The forms differ in their full
// barriers (kv_barrier) and their register split (kScoresRegs: in pairs Q's tile 0 stays in
// registers); the rest reads the cluster's size at run time (fold it, and ptxas spills
// in the pairs' page loop), so either form runs correctly in either launch.
template <typename Element_, KVCache kCache_ = KVCache::k16Bit, bool kE4m3Q_ = false, bool kTokenPages_ = false,
          bool kPairs_ = false>
struct SplitKVTraits {
    using Element = Element_;                  // Q, K, V, P (the NoPE part, for kFp8Sparse)
    static constexpr KVCache kCache = kCache_;
    static constexpr bool kE4m3Q = kE4m3Q_;
    static_assert(!kE4m3Q || kCache == KVCache::kFp8, "an e4m3 q: the dense FP8 cache only");
    static constexpr bool kSparse = kCache == KVCache::kFp8Sparse;
    static constexpr bool kTokenPages = kTokenPages_;
    static_assert(!kTokenPages || kCache != KVCache::kFp8Sparse, "one-token pages: the dense caches");
    static constexpr bool kPairs = kPairs_;
    static_assert(!kPairs || kCache == KVCache::kFp8Sparse, "pairs of CTAs: the sparse cache");
    static constexpr bool kProducer = kCache != KVCache::k16Bit;
    static constexpr bool kSeesaw = !kSparse;         // both consumer warpgroups compute scores
    // Who loads the pages. The 16-bit cache: the warps of a third warpgroup (SplitKVCta::run_loads),
    // so that the consumers only arrive on a barrier where a region of the page buffers is free.
    // The dense FP8 cache's one-token pages with a bf16 q: the expander, as it goes (the consumers
    // announce the regions in the same way: SplitKVCta::stage_for_expander). Otherwise the
    // consumers themselves, where a region is free.
    static constexpr bool kLoaderWarps = kCache == KVCache::k16Bit;
    static constexpr bool kExpanderStages = kCache == KVCache::kFp8 && kTokenPages && !kE4m3Q;
    static constexpr bool kConsumersLoad = !kLoaderWarps && !kExpanderStages;
    // QK^T takes a page's tiles from the last (8) down: the order the dense FP8 expander fills them.
    static constexpr bool kQkFromLastTile = kCache == KVCache::kFp8;
    // The full barrier (bar_kv[buf][...]) that completes a page's tile. The sparse producer
    // publishes a page in two groups, tiles 0-3 then 4-8; in the form for CTAs alone each group
    // completes on one barrier, so that QK^T waits twice a page instead of nine times (each wait a
    // round trip that left the tensor cores idle: 2.7 % faster). Pairs keep a barrier per tile:
    // one per group was 1 % slower there (docs/perf-notes.md section 56).
    static constexpr bool kGroupBarriers = kSparse && !kPairs;
    static constexpr int kv_barrier(int tile) { return kGroupBarriers ? (tile < 4 ? 0 : 1) : tile; }
    // The sparse empty barrier (bar_free[...]) of page buffer `buf`'s tile group `group` (0: tiles
    // 0-3 and the page's token mask, 1: tiles 4-8), released by the warpgroups that read it last,
    // in every CTA of the cluster: the scores warpgroups after P V_L (group 0), the values
    // warpgroups after P V_R (group 1; QK^T, tile 8's only reader, is done by then). Released as
    // one, the producer waited for both P Vs before storing group 0 (docs/perf-notes.md section 58).
    static constexpr int free_barrier(int group, int buf) { return 2 * group + buf; }
    // The caller's precision: q and O.
    using IoElement = cuda::std::conditional_t<kProducer, cutlass::bfloat16_t, Element>;
    // The RoPE tile (8) of Q and K.
    using RopeElement = cuda::std::conditional_t<kSparse, cutlass::bfloat16_t, Element>;
    static_assert(cuda::std::is_same_v<Element, cutlass::bfloat16_t> ||
                  cuda::std::is_same_v<Element, cutlass::half_t>, "bf16 or fp16");
    static_assert(!kProducer || cuda::std::is_same_v<Element, cutlass::half_t>, "FP8 caches: fp16 inside");

    // Two consumer warpgroups, each owning half of O's columns (+ the producer).
    static constexpr int kConsumerThreads = kSplitKVThreads;
    static constexpr int kThreads = kConsumerThreads + kProducerThreads;
    static_assert(kConsumerThreads == 256, "two consumer warpgroups");
    static_assert(kProducerThreads == 128, "one producer (loader) warpgroup");
    // FP8 caches: registers per thread after the split (setmaxnreg) of the pool that __launch_bounds__
    // gives (384 x 168). Sparse: the scores warpgroup holds S, P, O_L and Q's RoPE tile (pairs:
    // and Q's tile 0, so that QK^T reads 128 instead of 136 KB of shared memory a page), the
    // values warpgroup only O_R, and the producer a half page's NoPE values and scales per round
    // in flight (at 120 registers since the RoPE values go by cp.async; the form for CTAs alone,
    // bound by its producer, keeps 136 and spilled 20 B at 120: docs/perf-notes.md section 58). Dense:
    // the seesaw's two warpgroups as in the 16-bit kernel, and an expander that holds two tiles'
    // chunks (the next tile's read while one is written: at 40 registers their offsets spilled,
    // recomputed per tile they cost 5-10 %; docs/perf-notes.md section 18). The 16-bit cache: the
    // seesaw's warpgroups at 232 and the loader warps at 40 (at 240 / 24 the loader warps spilled
    // their request state).
    static constexpr int kScoresRegs = kSparse ? (kPairs ? 224 : 208) : kLoaderWarps ? 232 : 224;
    static constexpr int kValuesRegs = kSparse ? 160 : kLoaderWarps ? 232 : 224;
    static constexpr int kProducerRegs = kSparse ? (kPairs ? 120 : 136) : kLoaderWarps ? 40 : 56;
    static_assert(kScoresRegs + kValuesRegs + kProducerRegs == 3 * 168, "the register pool");

    using BlockM = Int<kBlockM>;
    using Page = Int<kBlockN>;
    using DimK = Int<kHeadDimK>;
    using HalfV = Int<kHeadDimV / 2>;

    // S = Q K^T for one page: 64 x 64, K = 576. Q from shared memory but its last 64 columns (the
    // RoPE tile), which come from registers (splitkv_gemm.cuh, qk_tiles).
    using MmaQK = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<BlockM, Page, DimK>,
                             GMMA::Major::K, GMMA::Major::K>()));
    using MmaQKRegQ = decltype(make_tiled_mma(
        GMMA::rs_op_selector<RopeElement, RopeElement, float, Shape<BlockM, Page, DimK>,
                             GMMA::Major::K, GMMA::Major::K>()));
    // The sparse pairs: Q's tile 0 from registers as well (fp16).
    using MmaQKRegQNoPE = decltype(make_tiled_mma(
        GMMA::rs_op_selector<Element, Element, float, Shape<BlockM, Page, DimK>,
                             GMMA::Major::K, GMMA::Major::K>()));
    // An e4m3 q: S = Q K^T over one staged box of Q and of K (64 rows x 128 e4m3 values each).
    using MmaQKE4m3 = decltype(make_tiled_mma(
        GMMA::ss_op_selector<cutlass::float_e4m3_t, cutlass::float_e4m3_t, float,
                             Shape<BlockM, Page, Int<kFp8StagedRowBytes>>, GMMA::Major::K, GMMA::Major::K>()));
    // O_half += P V_half: 64 x 256, K = 64 tokens. P from registers (own page) or from shared
    // memory (the other warpgroup's page); V is the cache tile read MN-major. An e4m3 q: P V is
    // an FP8 WGMMA too, P rounded to e4m3 and V transposed by the expander (K-major, fp8_expand.cuh).
    using PElement = cuda::std::conditional_t<kE4m3Q, cutlass::float_e4m3_t, Element>;
    static constexpr GMMA::Major kMajorV = kE4m3Q ? GMMA::Major::K : GMMA::Major::MN;
    using MmaPVRegP = decltype(make_tiled_mma(
        GMMA::rs_op_selector<PElement, PElement, float, Shape<BlockM, HalfV, Page>, GMMA::Major::K, kMajorV>()));
    using MmaPVSmemP = decltype(make_tiled_mma(
        GMMA::ss_op_selector<PElement, PElement, float, Shape<BlockM, HalfV, Page>, GMMA::Major::K, kMajorV>()));

    // A 64 x 64 tile with 128-byte swizzle: exactly what one TMA box writes.
    using SmemLayoutTile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                  Shape<Int<64>, Int<kTileCols>>{}));
    // 64 rows x 576 columns = 9 such tiles back to back (Q, and each K page).
    using SmemLayoutRows = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                  Shape<Int<64>, DimK>{}));
    // A staged box (fp8_staged.cuh): 64 rows x 128 e4m3 values, 128-byte swizzle.
    using SmemLayoutStagedBox = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::float_e4m3_t>{},
                                                       Shape<Int<64>, Int<kFp8StagedRowBytes>>{}));
    // The same page seen as V^T: (512 columns, 64 tokens).
    using SmemLayoutV = decltype(composition(
        SmemLayoutRows{}, make_layout(Shape<Int<kHeadDimV>, Page>{}, GenRowMajor{})));
    // An e4m3 q: half of V^T as the expander transposes it, (256 columns, 64 tokens), and P
    // (64 rows, 64 tokens): e4m3, K-major rows of 64 bytes, 64-byte swizzle (sw64_offset).
    using SmemLayoutVtHalf = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<cutlass::float_e4m3_t>{},
                                                    Shape<HalfV, Page>{}));
    using SmemLayoutPE4m3 = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<cutlass::float_e4m3_t>{},
                                                   Shape<BlockM, Page>{}));

    // Register fragments: S/P as accumulator (64 x 64), O half (64 x 256), and P or Q's last
    // tile as a 64 x 64 A operand in registers.
    using FragS = decltype(partition_fragment_C(MmaQK{}, Shape<BlockM, Page>{}));
    using FragO = decltype(partition_fragment_C(MmaPVRegP{}, Shape<BlockM, HalfV>{}));
    using LayoutFragA = Layout<Shape<Shape<_2, _2, _2>, _1, _4>, Stride<Stride<_1, _2, _4>, _0, _8>>;
    // P as the A operand of P V: as LayoutFragA, or for e4m3 four bytes of a row per register
    // (two k-steps of 32 tokens; p_to_e4m3).
    using LayoutFragAE4m3 = Layout<Shape<Shape<_4, _2, _2>, _1, _2>, Stride<Stride<_1, _4, _8>, _0, _16>>;
    using LayoutFragP = cuda::std::conditional_t<kE4m3Q, LayoutFragAE4m3, LayoutFragA>;

    struct alignas(1024) SharedStorage {
        // 128-byte-swizzled buffers must start on 1024-byte boundaries.
        alignas(1024) Element q[cosize_v<SmemLayoutRows>];       // tile 8 doubles as P1 (dense)
        alignas(1024) Element kv[2][cosize_v<SmemLayoutRows>];   // page 2i in kv[0], 2i+1 in kv[1]
        alignas(1024) Element p0[cosize_v<SmemLayoutTile>];      // warpgroup 0's P, for warpgroup 1
                                                                  // (an e4m3 q: and warpgroup 1's after it)
        float row_max[kBlockM];          // running max (log2 domain), shared by both warpgroups
        float scale0[kBlockM];           // rescale factor computed by warpgroup 0 this step (page)
        float scale1[kBlockM];           // ... by warpgroup 1
        float row_sum[2][kBlockM];       // per-warpgroup softmax denominators, for the epilogue
        float sink_log2[kBlockM];        // sparse: each row's attention sink times log2(e), -inf
                                         // without one (read once per CTA: load_sinks)
        int bad_request[2];              // a bad block id was seen (NaN output); slots: run_requests
        int split_base[2];               // sparse: num_splits of a split request (slot req & 1)
        uint8_t token_valid[2][8];       // sparse: per page buffer, bit t = token t is attended
        uint64_t bar_kv[2][kTilesK];     // one barrier per 64-column tile of each page buffer (full;
                                         // an e4m3 q: bar_kv[0][2 v + half], half of V^T buffer v)
        uint64_t bar_free[4];            // FP8 caches: a page buffer may be refilled (dense: its V_R;
                                         // an e4m3 q: V^T buffer b; sparse: a tile group, free_barrier)
        uint64_t bar_staged[2];          // dense FP8 cache: a page's e4m3 bytes are staged
        uint64_t bar_q;
        uint64_t bar_refill[4];          // 16-bit (and kExpanderStages): V0_L, V1_L, V0_R, V1_R may be
                                         // refilled (LoaderRefill)
        uint64_t bar_next_request;       // 16-bit (and kExpanderStages): the request's Q and pages are done with
        uint64_t bar_loads_issued;       // 16-bit: the loader warps have read the request's block ids
    };
    static_assert(sizeof(SharedStorage) <= 227 * 1024, "shared memory plan exceeds the 227 KB per block");
    static_assert(2 * kE4m3PBytes <= sizeof(SharedStorage::p0), "an e4m3 q: both P in p0");
#ifndef FLASHMLA_SPLITKV_SMEM_BYTES
#error "compile through flashmla_cupy (it defines the host-side shared-memory size)"
#endif
    static_assert(sizeof(SharedStorage) == FLASHMLA_SPLITKV_SMEM_BYTES, "host and device shared-memory sizes differ");
};

// An e4m3 q: V^T buffer `v` (fp8_staged.cuh), as the 16-bit pointer the P V functions take.
template <typename T>
__device__ __forceinline__ typename T::Element* transposed_v_buffer(typename T::SharedStorage& st, int v) {
    auto* base = v < 2 ? reinterpret_cast<uint8_t*>(st.kv[v]) + kTransposedVInPage
                       : reinterpret_cast<uint8_t*>(st.q) + kTransposedVInQ;
    return reinterpret_cast<typename T::Element*>(base);
}

// The 16-bit cache's refills (kExpanderStages: V0_L and V1_L, where the page after next is
// staged), each announced by its consumer warpgroup on bar_refill[i].
enum class LoaderRefill : int { kV0Left, kV1Left, kV0Right, kV1Right };

// Named barriers between the two warpgroups (0 is __syncthreads).
enum class WgBarrier : int {
    kScale0Ready = 1,     // warpgroup 0 published row_max / scale0 for this page pair
    kScale1Ready = 2,     // warpgroup 1 published scale1
    kP0Ready = 3,         // warpgroup 0 stored its rescaled P into p0
    kP1Issued = 4,        // warpgroup 1 stored P1 and issued its WGMMAs reading p0
    kRowMaxInit = 5,      // row_max initialized (warpgroup 0 only)
    kPReady = 1,          // FP8 caches: warpgroup 0 stored P and its rescale factors (p0, scale0)
    kPFree = 2,           // FP8 caches: warpgroup 1's WGMMA has read p0
    kConsumers = 8,       // both consumer warpgroups (with a producer: the __syncthreads)
};

// __syncthreads of the consumer warpgroups (the producer warpgroup does not take part).
template <typename T>
__device__ __forceinline__ void consumer_sync() {
    named_barrier_sync(int(WgBarrier::kConsumers), T::kConsumerThreads);
}

}  // namespace flashmla
