// Combine: for every request that the scheduler split across SM parts, merge the partial
// outputs o_accum (each normalized by its own sum) with weights exp2(lse_split - lse_total).
// Requests with one split were written directly by the split-KV kernel and are skipped.
//
// Grid: (batch, ceil(h_kv * q_rows / 8)); 8 warps, one query row per warp.
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "common/numeric.cuh"
#include "common/pdl.cuh"
#include "mla/config.cuh"
#include "mla/params.cuh"

namespace flashmla {

constexpr int kCombineWarps = 8;

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
    const int num_splits = p.num_splits[batch_idx + 1] - first_split;
    if (num_splits <= 1 || row_in_batch >= p.h_kv * p.q_rows) return;
    pdl_wait_for_producers();

    const int rows_per_split = p.h_kv * p.q_rows;
    const float* lse_accum = p.lse_accum + (int64_t)first_split * rows_per_split + row_in_batch;

    // Each lane reads its splits' lse once into its own slots of `weight` (no other lane touches
    // them before the __syncwarp), which then turn into the splits' weights.
    float* weight = split_weight + warp * p.max_splits;
    float max_lse = -kInf;
    for (int s = lane; s < num_splits; s += 32) {
        const float lse = lse_accum[(int64_t)s * rows_per_split];
        weight[s] = lse;
        max_lse = fmaxf(max_lse, lse);
    }
    #pragma unroll
    for (int offset = 16; offset >= 1; offset /= 2) {
        max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
    }
    if (max_lse == -kInf) max_lse = 0.0f;        // every split empty

    float sum = 0.0f;
    for (int s = lane; s < num_splits; s += 32) sum += exp2f(weight[s] - max_lse);
    #pragma unroll
    for (int offset = 16; offset >= 1; offset /= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    const float total_lse = (sum == 0.0f || sum != sum) ? kInf : log2f(sum) + max_lse;
    for (int s = lane; s < num_splits; s += 32) weight[s] = exp2f(weight[s] - total_lse);
    __syncwarp();

    // Each lane owns 16 of the 512 columns as four float4 (coalesced across the warp).
    constexpr int kVecs = kHeadDimV / (32 * 4);
    float4 acc[kVecs];
    #pragma unroll
    for (int v = 0; v < kVecs; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4* o_accum = reinterpret_cast<const float4*>(
        p.o_accum + ((int64_t)first_split * rows_per_split + row_in_batch) * kHeadDimV);
    const int64_t split_stride = (int64_t)rows_per_split * kHeadDimV / 4;
    // No branch on the weight inside: an empty split's rows hold zeros (weight 0), and without
    // a branch the loads of several splits are in flight at once.
    #pragma unroll 4
    for (int s = 0; s < num_splits; ++s) {
        const float w = weight[s];
        #pragma unroll
        for (int v = 0; v < kVecs; ++v) {
            const float4 x = o_accum[s * split_stride + v * 32 + lane];
            acc[v].x += w * x.x; acc[v].y += w * x.y; acc[v].z += w * x.z; acc[v].w += w * x.w;
        }
    }
    pdl_allow_dependents();

    const int kv_head = row_in_batch / p.q_rows, q_row = row_in_batch % p.q_rows;
    Element* o = static_cast<Element*>(p.o) +
                 (((int64_t)batch_idx * p.q_rows + q_row) * p.h_kv + kv_head) * kHeadDimV;
    cutlass::NumericArrayConverter<Element, float, 4> convert;
    #pragma unroll
    for (int v = 0; v < kVecs; ++v) {
        cutlass::Array<float, 4> x;
        x[0] = acc[v].x; x[1] = acc[v].y; x[2] = acc[v].z; x[3] = acc[v].w;
        *reinterpret_cast<cutlass::Array<Element, 4>*>(o + (v * 32 + lane) * 4) = convert(x);
    }
    if (lane == 0) {
        const int head = kv_head * p.heads_per_kv + q_row % p.heads_per_kv;
        const int token = q_row / p.heads_per_kv;
        p.lse[((int64_t)batch_idx * p.h_q + head) * p.s_q + token] = total_lse / kLog2e;
    }
}

}  // namespace flashmla
