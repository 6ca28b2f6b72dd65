// What both forms of the narrow kernel (fp8_narrow_kernel.cu) share: the shared-memory layout,
// the consumer warps' barriers, a few PTX moves, and the consumers' base (Q's load and the
// output writes).
#pragma once
#include <cuda/std/cstdint>

#include "common/numeric.cuh"
#include "common/sync.cuh"
#include "common/tma.cuh"
#include "mla/config.cuh"
#include "mla/fp8_staged.cuh"
#include "mla/output_layout.cuh"
#include "mla/params.cuh"
#include "mla/splitkv_schedule.cuh"

namespace flashmla {

// A consumer group is four warps (one warpgroup); both forms have two, which take the pages in turn
// and merge their rows at the end of a request (with one, every latency of a page is exposed:
// docs/perf-notes.md sections 22 and 26).
constexpr int kNarrowWarps = 4;
constexpr int kNarrowGroups = kFp8NarrowThreads / 128 - 1;
static_assert(kNarrowWarps * 16 == kBlockN && kNarrowWarps * 128 == kHeadDimV, "a warp's tokens and columns");
static_assert(kNarrowGroups == 2, "two groups and a loading warpgroup");
// The ring's pages alternate between the groups, and with an odd ring so do a stage's pages. A
// parity wait must trail its barrier by at most one phase, so each group has its own "full"
// barrier per stage: with one, a group waiting for its page could find the stage still in the
// other group's phase, whose parity is its own page's from two phases before, and run on the old
// bytes (launch failures and hangs, docs/perf-notes.md section 29). Page n is use n / kStageRound
// of its group's barrier; the loader sees every phase of `empty` and needs one per stage.
constexpr int kStageRound = kFp8NarrowStages * kNarrowGroups;
static_assert(kFp8NarrowStages % 2 == 1, "an odd ring: a stage's pages alternate between the groups");

struct alignas(1024) NarrowStorage {
    alignas(1024) uint8_t stage[kFp8NarrowStages][kStagedPageBytes];   // staged pages, boxes packed
    // Q: nine swizzled 64 x 64 tiles (bf16, then fp16); at a request's end, the second group's O
    alignas(1024) uint16_t q[kTilesK * 64 * kTileCols];
    alignas(1024) uint16_t p[kNarrowGroups][2][kFp8NarrowRows * kBlockN];   // per group, P (fp16) of its even / odd pages
    float page_max[kNarrowGroups][2][kNarrowWarps][kFp8NarrowRows];    // each warp's row max of the page (log2)
    float row_sum[kNarrowGroups][kNarrowWarps][kFp8NarrowRows];        // each warp's share of the softmax sums
    float merge_max[kNarrowGroups][kFp8NarrowRows];                    // the groups' rows at a request's end
    float merge_sum[kFp8NarrowRows];
    int merge_bad;                                                     // the second group met a bad block id
    int bad_page[kFp8NarrowStages];                                    // the stage's page met a bad block id
    uint64_t full[kNarrowGroups][kFp8NarrowStages];                    // the stage's bytes (a page of that group) landed
    uint64_t empty[kFp8NarrowStages];                                  // every consumer warp is done with it
    uint64_t bar_q;
};
#ifndef FLASHMLA_FP8_NARROW_SMEM_BYTES
#error "compile through flashmla_cupy (it defines the host-side shared-memory size)"
#endif
static_assert(sizeof(NarrowStorage) == FLASHMLA_FP8_NARROW_SMEM_BYTES, "host and device shared-memory sizes differ");

// Named barriers (0 is __syncthreads): of all consumer warps, then of one group's (id + 4 group).
enum class NarrowBarrier : int { kQReady = 1, kGroupsDone = 2, kMerged = 3,
                                 kPageMax = 4, kPReady = 5, kSums = 6, kMergeRead = 7 };


__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Where a request's rows go: the final output (split < 0) or a split's fp32 rows; `rows`: the rows
// that may be written (0 when the schedule is bad).
struct NarrowOutput {
    int req, split, rows;
    bool bad;
    float v_scale;
};

// The consumer warps' common part; the forms add their fragments, softmax and output layout.
struct NarrowConsumerBase {
    static constexpr int kGroups = kNarrowGroups;
    static constexpr int kThreads = kFp8NarrowThreads;             // and a loading warpgroup
    static constexpr int kLoaderRegs = 24, kConsumerRegs = 240;    // setmaxnreg: 2 x 240 + 24 = 3 x 168
    static constexpr int kConsumerThreads = 32 * kNarrowWarps * kGroups;
    const SplitKVParams& p;
    NarrowStorage& st;
    const int group, warp, lane, quad, quad_row;   // warp: within the group; quad: lane % 4; quad_row: lane / 4
    const float scale_log2;                        // the softmax scale times k_scale, log2 domain
    int n = 0;                                     // pages of all groups: stage n % kFp8NarrowStages

    __device__ __forceinline__ NarrowConsumerBase(const SplitKVParams& params, NarrowStorage& storage)
        : p(params), st(storage), group(threadIdx.x / 128), warp(threadIdx.x / 32 % kNarrowWarps),
          lane(threadIdx.x % 32), quad(lane % 4), quad_row(lane / 4), scale_log2(params.scale_log2 * *params.kv_scale) {}

    // Page n is group n % kGroups's: how many pages from n to this group's next; its P buffer and
    // row-max slot alternate over the group's pages.
    __device__ __forceinline__ int pages_to_mine() const { return (group + kGroups - n % kGroups) % kGroups; }
    __device__ __forceinline__ int buffer() const { return (n / kGroups) & 1; }

    __device__ __forceinline__ void sync_consumers(NarrowBarrier id) const {
        named_barrier_sync(int(id), kConsumerThreads);
    }
    __device__ __forceinline__ void sync_group(NarrowBarrier id) const {
        named_barrier_sync(int(id) + 4 * group, 32 * kNarrowWarps);
    }

    // One thread issues all of Q for `req` (nine 64 x 64 tiles; rows past q_rows are TMA's zeros).
    __device__ __forceinline__ void load_q(int req) const {
        const uint32_t bar = smem_u32(&st.bar_q);
        mbarrier_arrive_expect_tx(bar, kTilesK * kFp16TileBytes);
        #pragma unroll
        for (int t = 0; t < kTilesK; ++t) {
            tma_load_4d(&p.tma_q, bar, smem_u32(st.q) + t * kFp16TileBytes, t * kTileCols, 0, blockIdx.y, req,
                        L2Hint::kEvictFirst);
        }
    }

    // The second group's rows into the first's at the request's end: both scale theirs to the
    // rows' common max, then the second passes its O (fp32, through Q's buffer: both groups are
    // past Q), sums and bad flag. `o`: this thread's O, whose element e of a tile belongs to row
    // slot slot(e) (row row(i) for slot i); `writes_rows`: this thread writes its slots' max and
    // sum for the group (one thread per row). Returns whether this thread stores (the first group).
    template <int kTiles, int kPerTile, int kSlots, typename Slot, typename Row>
    __device__ __forceinline__ bool merge_groups(float (&o)[kTiles][kPerTile], float (&row_max)[kSlots],
                                                 float (&sums)[kSlots], bool& bad, bool writes_rows, Slot slot,
                                                 Row row) const {
        static_assert(kTiles * kPerTile * 128 * sizeof(float) <= sizeof(st.q), "the second group's O fits in Q's buffer");
        static_assert(kPerTile % 4 == 0, "O passed as float4");
        if (writes_rows) {
            #pragma unroll
            for (int i = 0; i < kSlots; ++i) st.merge_max[group][row(i)] = row_max[i];
        }
        sync_consumers(NarrowBarrier::kGroupsDone);
        float factor[kSlots];
        #pragma unroll
        for (int i = 0; i < kSlots; ++i) {
            const float m = fmaxf(st.merge_max[0][row(i)], st.merge_max[1][row(i)]);
            factor[i] = m == -kInf ? 0.0f : exp2_approx(row_max[i] - m);
            sums[i] *= factor[i];
            row_max[i] = m;
        }
        #pragma unroll
        for (int t = 0; t < kTiles; ++t) {
            #pragma unroll
            for (int e = 0; e < kPerTile; ++e) o[t][e] *= factor[slot(e)];
        }
        // [kPerTile / 4 tile + c][thread]: o[tile][4c..4c+3] (the address from here: hoisted out of
        // the request loop, the addresses took registers)
        constexpr int kChunks = kPerTile / 4;
        float4* other_o = computed_here(reinterpret_cast<float4*>(st.q)) + threadIdx.x % 128;
        if (group == 1) {
            #pragma unroll
            for (int t = 0; t < kTiles; ++t) {
                #pragma unroll
                for (int c = 0; c < kChunks; ++c) {
                    other_o[(kChunks * t + c) * 128] = make_float4(o[t][4 * c], o[t][4 * c + 1], o[t][4 * c + 2], o[t][4 * c + 3]);
                }
            }
            if (writes_rows) {
                #pragma unroll
                for (int i = 0; i < kSlots; ++i) st.merge_sum[row(i)] = sums[i];
            }
            if (threadIdx.x % 128 == 0) st.merge_bad = bad;           // alike in the group (its pages' flags)
        }
        sync_consumers(NarrowBarrier::kMerged);
        if (group == 1) return false;
        bad |= st.merge_bad != 0;
        #pragma unroll
        for (int i = 0; i < kSlots; ++i) sums[i] += st.merge_sum[row(i)];
        #pragma unroll
        for (int t = 0; t < kTiles; ++t) {
            #pragma unroll
            for (int c = 0; c < kChunks; ++c) {
                const float4 v = other_o[(kChunks * t + c) * 128];
                o[t][4 * c] += v.x;
                o[t][4 * c + 1] += v.y;
                o[t][4 * c + 2] += v.z;
                o[t][4 * c + 3] += v.w;
            }
        }
        sync_group(NarrowBarrier::kMergeRead);                        // Q's buffer is free for the next load
        return true;
    }

    // The request's destination; reports a split index outside the metadata's range.
    __device__ __forceinline__ NarrowOutput output(int req, const SchedRow& row, const RequestSpan& span,
                                                  bool bad) const {
        const long long split = (long long)p.num_splits[req] + (req == row.range.x ? row.begin_split : 0);
        NarrowOutput out{req, span.whole ? -1 : static_cast<int>(split), p.q_rows, bad || span.bad, *p.kv_scale};
        if (!span.whole && (split < 0 || split >= p.total_splits)) {
            if (threadIdx.x == 0) report_error(p.error, FLASHMLA_ERROR_SCHEDULE, req, 0, static_cast<int>(split), p.total_splits);
            out.rows = 0;                                         // nowhere valid to write
        }
        return out;
    }

    // O's factor for a row: 1 / sum (times k_scale), 0 rows for no visible token, NaN when bad.
    __device__ __forceinline__ static float row_factor(const NarrowOutput& out, float sum) {
        return out.bad ? kNaN : no_visible_token(sum) ? 1.0f : out.v_scale / sum;
    }

    // O's columns col..col + 7 of `q_row` (already scaled): bf16 output or a split's fp32 row.
    __device__ __forceinline__ void write_columns(const NarrowOutput& out, int q_row, int col, const float (&v)[8]) const {
        if (out.split < 0) {
            const uint4 packed = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]),
                                            pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
            *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.o) +
                (((int64_t)out.req * p.q_rows + q_row) * p.h_kv + blockIdx.y) * kHeadDimV + col) = packed;
        } else {
            float4* dst = reinterpret_cast<float4*>(p.o_accum +
                (((int64_t)out.split * p.h_kv + blockIdx.y) * p.q_rows + q_row) * kHeadDimV + col);
            dst[0] = make_float4(v[0], v[1], v[2], v[3]);
            dst[1] = make_float4(v[4], v[5], v[6], v[7]);
        }
    }

    // lse of `q_row` (natural log, or a split's log2 for the combine kernel).
    __device__ __forceinline__ void write_lse(const NarrowOutput& out, int q_row, float sum, float row_max) const {
        const float lse = row_lse(sum, row_max, out.bad, out.split >= 0);
        if (out.split < 0) {
            const int head = blockIdx.y * p.heads_per_kv + q_row % p.heads_per_kv;
            p.lse[lse_index(out.req, head, q_row / p.heads_per_kv, p.h_q, p.s_q, 1)] = lse;
        } else {
            p.lse_accum[((int64_t)out.split * p.h_kv + blockIdx.y) * p.q_rows + q_row] = lse;
        }
    }

    __device__ __forceinline__ static uint32_t pack_bf16x2(float lo, float hi) {
        uint32_t d;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
        return d;
    }

    __device__ __forceinline__ static uint32_t pack_fp16x2(float lo, float hi) {
        uint32_t d;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
        return d;
    }
};

}  // namespace flashmla
