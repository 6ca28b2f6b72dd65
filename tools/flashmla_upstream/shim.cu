// C entry points (for ctypes) around FlashMLA upstream's sm90 decoding: its scheduler, its dense
// and sparse FP8 split-KV kernels and its combine kernel, called as upstream's
// csrc/api/dense_decode.h and sparse_decode.h call them. For side-by-side timing only
// (tools/flashmla_upstream/README.md); flashmla-cupy does not use it. Supports what the profiler's
// grids need: h_kv = 1, contiguous q, k_cache, indices, out and lse.
#include <cuda_runtime_api.h>
#include <cmath>
#include <cstdlib>
#include <cutlass/half.h>

#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {
constexpr int kHeadDimK = 576, kHeadDimV = 512, kPageBlock = 64, kFixedOverheadBlocks = 5;

#ifdef FLASHMLA_UP_STAMPS
// timeline.py's stamped build: the kernels' stamp buffer, a device address in FLASHMLA_UP_STAMPS
// (read per call; unset: no stamps).
unsigned long long* stamp_buffer() {
    const char* address = std::getenv("FLASHMLA_UP_STAMPS");
    return address ? reinterpret_cast<unsigned long long*>(std::strtoull(address, nullptr, 0)) : nullptr;
}
#endif
}

extern "C" int up_sched_meta_bytes() { return static_cast<int>(sizeof(DecodingSchedMeta)); }

// Upstream's tile scheduler: `sched` [num_sm_parts] DecodingSchedMeta, `num_splits` [b + 1].
// topk -1: dense (by `seqlens`); else sparse, `topk` indices per query token (seqlens unused).
extern "C" int up_sched(int b, int s_q, int num_sm_parts, int topk, int* seqlens, void* sched, int* num_splits,
                        void* stream) {
    GetDecodeSchedMetaParams p = {b, s_q, kPageBlock, kFixedOverheadBlocks, topk, -1, nullptr, nullptr,
                                  topk < 0 ? seqlens : nullptr, static_cast<DecodingSchedMeta*>(sched), num_splits,
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
#ifdef FLASHMLA_UP_STAMPS
    p.fm_probe = stamp_buffer();
#endif
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

// Sparse FP8 decoding (DeepSeek-V3.2's 656-byte tokens) + combine. q [b, s_q, h_q, 576] bf16;
// k_cache [num_blocks, page, 1, 656] bytes; indices [b, s_q, topk]; attn_sink [h_q] or null;
// out [b, s_q, h_q, 512]; lse [b, s_q, h_q]; lse_accum / o_accum [b + num_sm_parts, s_q, h_q(, 512)].
extern "C" int up_sparse_decode(int b, int s_q, int h_q, int num_blocks, int page, int topk, float scale,
                                void* q, void* k_cache, int* indices, float* attn_sink, void* sched,
                                int num_sm_parts, int* num_splits, void* out, float* lse, float* lse_accum,
                                float* o_accum, void* stream) {
    constexpr int kTokenBytes = 656;
    using bf16 = cutlass::bfloat16_t;
    const int rows = s_q * h_q;
    SparseAttnDecodeParams p = {};
    p.b = b;
    p.s_q = s_q;
    p.h_q = h_q;
    p.h_kv = 1;
    p.d_qk = kHeadDimK;
    p.d_v = kHeadDimV;
    p.sm_scale = scale;
    p.sm_scale_div_log2 = static_cast<float>(scale * M_LOG2E);
    p.num_blocks = num_blocks;
    p.page_block_size = page;
    p.topk = topk;
    p.model_type = ModelType::V32;
    p.q = static_cast<bf16*>(q);
    p.kv = static_cast<bf16*>(k_cache);
    p.indices = indices;
    p.attn_sink = attn_sink;
    p.lse = lse;
    p.out = static_cast<bf16*>(out);
    p.stride_q_b = rows * kHeadDimK;
    p.stride_q_s_q = h_q * kHeadDimK;
    p.stride_q_h_q = kHeadDimK;
    p.stride_kv_block = page * kTokenBytes;
    p.stride_kv_row = kTokenBytes;
    p.stride_indices_b = s_q * topk;
    p.stride_indices_s_q = topk;
    p.stride_lse_b = rows;
    p.stride_lse_s_q = h_q;
    p.stride_o_b = rows * kHeadDimV;
    p.stride_o_s_q = h_q * kHeadDimV;
    p.stride_o_h_q = kHeadDimV;
    p.stream = static_cast<cudaStream_t>(stream);
#ifdef FLASHMLA_UP_STAMPS
    p.fm_probe = stamp_buffer();
#endif
    p.lse_accum = lse_accum;
    p.o_accum = o_accum;
    p.stride_lse_accum_split = rows;
    p.stride_lse_accum_s_q = h_q;
    p.stride_o_accum_split = rows * kHeadDimV;
    p.stride_o_accum_s_q = h_q * kHeadDimV;
    p.stride_o_accum_h_q = kHeadDimV;
    p.tile_scheduler_metadata_ptr = static_cast<DecodingSchedMeta*>(sched);
    p.num_splits_ptr = num_splits;
    p.num_sm_parts = num_sm_parts;
    if (h_q == 64) sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 64>(p);
    else if (h_q == 128) sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 128>(p);
    else return static_cast<int>(cudaErrorInvalidValue);

    CombineParams c = {b, s_q, h_q, kHeadDimV,
                       lse, out, p.stride_lse_b, p.stride_lse_s_q, p.stride_o_b, p.stride_o_s_q, p.stride_o_h_q,
                       lse_accum, o_accum, p.stride_lse_accum_split, p.stride_lse_accum_s_q,
                       p.stride_o_accum_split, p.stride_o_accum_s_q, p.stride_o_accum_h_q,
                       p.tile_scheduler_metadata_ptr, num_splits, num_sm_parts, attn_sink, p.stream};
    smxx::decode::run_flash_mla_combine_kernel<bf16>(c);
    return static_cast<int>(cudaGetLastError());
}
