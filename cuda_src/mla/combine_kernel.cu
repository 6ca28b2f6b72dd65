// Combine: for every request that the scheduler split across SM parts, merge the partial
// outputs o_accum (each normalized by its own sum) with weights exp2(lse_split - lse_total).
// Requests with one split were written directly by the split-KV kernel and are skipped.
// A NaN split (a bad length or block id, see splitkv_kernel.cu) makes the row NaN; split
// indices outside the workspace (metadata not from this batch) are reported and never read.
//
// Grid: (batch, ceil(h_kv * q_rows / kCombineWarps)); one query row per warp.
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "common/error.cuh"
#include "common/numeric.cuh"
#include "common/pdl.cuh"
#include "mla/config.cuh"
#include "mla/output_layout.cuh"
#include "mla/params.cuh"

namespace flashmla {

constexpr int kCombineVecs = kHeadDimV / (32 * 4);   // float4s per lane: 16 of the 512 columns
constexpr int kSplitsAhead = 4;                       // splits' rows in flight per lane

// Row `row_in_batch` of request `batch_idx`: O in the input precision, lse in natural log.
template <typename Element>
__device__ __forceinline__ void store_row(const CombineParams& p, int batch_idx, int row_in_batch,
                                          const float4 (&acc)[kCombineVecs], float total_lse, int lane) {
    const int kv_head = row_in_batch / p.q_rows, q_row = row_in_batch % p.q_rows;
    const int head = kv_head * p.heads_per_kv + q_row % p.heads_per_kv;
    const int token = q_row / p.heads_per_kv;
    Element* o = static_cast<Element*>(p.o) +
                 (((int64_t)batch_idx * p.q_rows + q_row) * p.h_kv + kv_head) * kHeadDimV;
    const float factor = sink_factor(p.attn_sink, head, total_lse);
    cutlass::NumericArrayConverter<Element, float, 4> convert;
    #pragma unroll
    for (int v = 0; v < kCombineVecs; ++v) {
        cutlass::Array<float, 4> x;
        x[0] = acc[v].x * factor; x[1] = acc[v].y * factor; x[2] = acc[v].z * factor; x[3] = acc[v].w * factor;
        *reinterpret_cast<cutlass::Array<Element, 4>*>(o + (v * 32 + lane) * 4) = convert(x);
    }
    if (lane == 0) p.lse[lse_index(batch_idx, head, token, p.h_q, p.s_q, p.sparse_s_q)] = total_lse / kLog2e;
}

template <typename Element>
__global__ void __launch_bounds__(kCombineWarps * 32)
mla_combine_kernel(const __grid_constant__ CombineParams p) {
    extern __shared__ float split_weight[];          // [kCombineWarps][max_splits]
    const int batch_idx = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row_in_batch = blockIdx.y * kCombineWarps + warp;   // (kv head, q row) flattened

    // num_splits comes from the metadata kernel, which completed before the split-KV kernel
    // (our producer) got past its own dependency wait; reading it first is safe.
    const int first_split = p.num_splits[batch_idx];
    const long long num_splits_wide = (long long)p.num_splits[batch_idx + 1] - first_split;
    if (num_splits_wide <= 1 || row_in_batch >= p.h_kv * p.q_rows) return;
    pdl_wait_for_producers();

    if (first_split < 0 || num_splits_wide > p.max_splits || first_split + num_splits_wide > p.total_splits) {
        if (row_in_batch == 0 && lane == 0) {
            report_error(p.error, FLASHMLA_ERROR_SCHEDULE, batch_idx, 0, first_split, p.total_splits);
        }
        float4 nan[kCombineVecs];
        #pragma unroll
        for (int v = 0; v < kCombineVecs; ++v) nan[v] = make_float4(kNaN, kNaN, kNaN, kNaN);
        store_row<Element>(p, batch_idx, row_in_batch, nan, kNaN, lane);
        return;
    }
    const int num_splits = static_cast<int>(num_splits_wide);
    const int rows_per_split = p.h_kv * p.q_rows;
    const float* lse_accum = p.lse_accum + (int64_t)first_split * rows_per_split + row_in_batch;

    // Each lane owns 16 of the 512 columns as four float4 (coalesced across the warp). The first
    // splits' rows are loaded before their weights are known, so that their latency overlaps the
    // lse's; then kSplitsAhead splits stay in flight, each reloaded as soon as it is added.
    const float4* o_accum = reinterpret_cast<const float4*>(
        p.o_accum + ((int64_t)first_split * rows_per_split + row_in_batch) * kHeadDimV);
    const int64_t split_stride = (int64_t)rows_per_split * kHeadDimV / 4;
    float4 rows[kSplitsAhead][kCombineVecs];
    #pragma unroll
    for (int i = 0; i < kSplitsAhead; ++i) {
        #pragma unroll
        for (int v = 0; v < kCombineVecs; ++v) {
            rows[i][v] = i < num_splits ? o_accum[i * split_stride + v * 32 + lane] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }

    // Each lane reads its splits' lse once into its own slots of `weight` (no other lane touches
    // them before the __syncwarp), which then turn into the splits' weights.
    float* weight = split_weight + warp * p.max_splits;
    float max_lse = -kInf;
    bool any_nan = false;
    for (int s = lane; s < num_splits; s += 32) {
        const float lse = lse_accum[(int64_t)s * rows_per_split];
        weight[s] = lse;
        any_nan |= lse != lse;
        max_lse = fmaxf(max_lse, lse);
    }
    #pragma unroll
    for (int offset = 16; offset >= 1; offset /= 2) {
        max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
    }
    if (__any_sync(0xffffffffu, any_nan)) max_lse = kNaN;   // every weight becomes NaN
    if (max_lse == -kInf) max_lse = 0.0f;        // every split empty

    float sum = 0.0f;
    for (int s = lane; s < num_splits; s += 32) sum += exp2f(weight[s] - max_lse);
    #pragma unroll
    for (int offset = 16; offset >= 1; offset /= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    const float total_lse = sum == 0.0f ? kInf : log2f(sum) + max_lse;    // NaN stays NaN
    for (int s = lane; s < num_splits; s += 32) weight[s] = exp2f(weight[s] - total_lse);
    __syncwarp();

    float4 acc[kCombineVecs];
    #pragma unroll
    for (int v = 0; v < kCombineVecs; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
    // No branch on the weight: an empty split's rows hold zeros (weight 0).
    #pragma unroll 1
    for (int s = 0; s < num_splits; s += kSplitsAhead) {
        #pragma unroll
        for (int i = 0; i < kSplitsAhead; ++i) {
            if (s + i >= num_splits) break;
            const float w = weight[s + i];
            const int next = s + i + kSplitsAhead;
            #pragma unroll
            for (int v = 0; v < kCombineVecs; ++v) {
                const float4 x = rows[i][v];
                acc[v].x += w * x.x; acc[v].y += w * x.y; acc[v].z += w * x.z; acc[v].w += w * x.w;
                if (next < num_splits) rows[i][v] = o_accum[next * split_stride + v * 32 + lane];
            }
        }
    }
    pdl_allow_dependents();
    store_row<Element>(p, batch_idx, row_in_batch, acc, total_lse, lane);
}

}  // namespace flashmla
