// C entry points (for ctypes) around FlashMLA upstream's sm90 dense decoding: its scheduler, its
// split-KV kernel and its combine kernel, called as upstream's csrc/api/dense_decode.h calls them.
// For side-by-side timing only (tools/flashmla_upstream/README.md); flashmla-cupy does not use it.
// Supports what the profiler's grid needs: h_kv = 1, contiguous q, k_cache, out and lse.
#include <cuda_runtime_api.h>
#include <cmath>
#include <cutlass/half.h>

#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {
constexpr int kHeadDimK = 576, kHeadDimV = 512, kPageBlock = 64, kFixedOverheadBlocks = 5;
}

extern "C" int up_sched_meta_bytes() { return static_cast<int>(sizeof(DecodingSchedMeta)); }

// Upstream's tile scheduler: `sched` [num_sm_parts] DecodingSchedMeta, `num_splits` [b + 1].
extern "C" int up_sched(int b, int s_q, int num_sm_parts, int* seqlens, void* sched, int* num_splits,
                        void* stream) {
    GetDecodeSchedMetaParams p = {b, s_q, kPageBlock, kFixedOverheadBlocks, -1, -1, nullptr, nullptr,
                                  seqlens, static_cast<DecodingSchedMeta*>(sched), num_splits,
                                  num_sm_parts, static_cast<cudaStream_t>(stream)};
    smxx::decode::run_get_decoding_sched_meta_kernel(p);
    return static_cast<int>(cudaGetLastError());
}

// Split-KV + combine. q [b, s_q * h_q, 576]; k_cache [num_blocks, 64, 576]; out [b, s_q * h_q, 512];
// lse [b, s_q * h_q] (log-sum-exp per query row); lse_accum / o_accum [b + num_sm_parts, rows(, 512)].
extern "C" int up_decode(int is_fp16, int b, int s_q, int h_q, int num_blocks, int max_blocks, int causal,
                         float scale, void* q, void* k_cache, int* block_table, int* seqlens, void* sched,
                         int num_sm_parts, int* num_splits, void* out, float* lse, float* lse_accum,
                         float* o_accum, void* stream) {
    const int rows = s_q * h_q;
    DenseAttnDecodeParams p;
    p.b = b;
    p.s_q = s_q;
    p.q_seq_per_hk = rows;
    p.d = kHeadDimK;
    p.d_v = kHeadDimV;
    p.h_q = h_q;
    p.h_k = 1;
    p.num_blocks = num_blocks;
    p.q_head_per_hk = h_q;
    p.is_causal = causal && s_q > 1;
    p.scale_softmax = scale;
    p.scale_softmax_log2 = static_cast<float>(scale * M_LOG2E);
    p.q_ptr = q;
    p.k_ptr = k_cache;
    p.o_ptr = out;
    p.softmax_lse_ptr = lse;
    p.q_batch_stride = static_cast<int64_t>(rows) * kHeadDimK;
    p.q_row_stride = p.q_head_stride = kHeadDimK;
    p.k_batch_stride = kPageBlock * kHeadDimK;
    p.k_row_stride = p.k_head_stride = kHeadDimK;
    p.o_batch_stride = p.o_head_stride = static_cast<int64_t>(rows) * kHeadDimV;
    p.o_row_stride = kHeadDimV;
    p.block_table = block_table;
    p.block_table_batch_stride = max_blocks;
    p.page_block_size = kPageBlock;
    p.seqlens_k_ptr = seqlens;
    p.tile_scheduler_metadata_ptr = static_cast<DecodingSchedMeta*>(sched);
    p.num_sm_parts = num_sm_parts;
    p.num_splits_ptr = num_splits;
    p.total_num_splits = b + num_sm_parts;
    p.softmax_lseaccum_ptr = lse_accum;
    p.oaccum_ptr = o_accum;
    p.stream = static_cast<cudaStream_t>(stream);
    if (is_fp16) sm90::run_flash_splitkv_mla_kernel<cutlass::half_t>(p);
    else sm90::run_flash_splitkv_mla_kernel<cutlass::bfloat16_t>(p);

    CombineParams c = {b, s_q, h_q, kHeadDimV,
                       lse, out, rows, h_q, rows * kHeadDimV, h_q * kHeadDimV, kHeadDimV,
                       lse_accum, o_accum, rows, h_q, rows * kHeadDimV, h_q * kHeadDimV, kHeadDimV,
                       p.tile_scheduler_metadata_ptr, num_splits, num_sm_parts, nullptr, p.stream};
    if (is_fp16) smxx::decode::run_flash_mla_combine_kernel<cutlass::half_t>(c);
    else smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
    return static_cast<int>(cudaGetLastError());
}
