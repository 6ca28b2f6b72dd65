// Kernel parameters: the one place where device and host meet.
//
// flashmla_cupy/params.py mirrors each struct field by field (ctypes), in the same order; a CPU
// test parses this file and compares the two, and every MLA program is compiled with the sizes
// the host computed, checked here. One field per line, no nested declarations, so that the test
// can read it.
#pragma once
#include <cuda/std/cstdint>
#include "common/tma.cuh"

namespace flashmla {

// Split-KV kernel. Query rows are (MTP token, head-in-group) pairs: row = s * heads_per_kv + h.
struct SplitKVParams {
    TensorMap tma_q;              // Q as [batch][q_rows][h_kv][576], box 64 x 64 (an e4m3 q: bytes, boxes of 128, fp8_staged.cuh)
    TensorMap tma_kv;             // KV cache as [num_blocks][page_block_size][h_kv][576], box min(page_block_size, 64) x 64
    const int* block_table;       // [batch][block_table_stride]
    const int* seqlens;           // [batch]
    const int* sched_meta;        // [num_sm_parts][8] (layout: config.cuh, kSchedMetaInts)
    const int* num_splits;        // [batch + 1], prefix sums of splits per request
    float* lse;                   // [batch][h_q][s_q], natural log
    float* lse_accum;             // [total_splits][h_kv][q_rows], log2
    float* o_accum;               // [total_splits][h_kv][q_rows][512]
    void* o;                      // [batch][q_rows][h_kv][512], q's dtype
    int* error;                   // ErrorRecord in mapped host memory, or null (record nothing)
    const int* indices;           // sparse: [batch][s_q][topk] token ids, block * page + offset
    const int* topk_length;       // sparse: [batch] or null: only the first topk_length[b] ids count
    const float* attn_sink;       // sparse: [h_q] or null
    const uint8_t* cache;         // the cache's bytes (sparse: kFp8TokenBytes per token; dense FP8: kHeadDimK; 16-bit: 2 kHeadDimK)
    const float* kv_scale;        // dense FP8 cache: its dequantization scale (one float)
    const float* q_scale;         // dense FP8 cache: an e4m3 q's dequantization scale (one float), or null: bf16 q
    int64_t block_table_stride;
    int max_blocks_per_seq;       // block_table's columns: seqlens must be <= page_block_size * this
    int num_blocks;               // k_cache's blocks: block ids must be in [0, num_blocks)
    int total_splits;             // rows of lse_accum / o_accum (batch + num_sm_parts)
    int batch;
    int s_q;
    int q_rows;                   // s_q * heads_per_kv
    int heads_per_kv;
    int h_q;
    int h_kv;
    int causal;
    float scale_log2;             // softmax_scale * log2(e)
    int64_t indices_stride_b;     // sparse: elements between requests / query tokens of indices
    int64_t indices_stride_s;
    int64_t cache_block_stride;   // bytes between cache blocks
    int64_t cache_head_stride;    // dense caches: bytes between KV heads
    int64_t cache_tokens;         // sparse: num_blocks * page_block_size (ids outside are skipped)
    int topk;                     // sparse: indices' last dim
    int page_block_size;          // tokens per cache block (dense: a power of two)
    int page_shift;               // dense caches: log2(page_block_size)
    int piece_shift;              // dense: log2(min(page_block_size, 64)), the rows of a cache box
    int sparse_s_q;               // sparse: query tokens folded into the request axis (dense: 1)
};

// Combine kernel: merges the splits of requests that were split across SM parts.
struct CombineParams {
    const int* num_splits;        // [batch + 1]
    const float* lse_accum;       // [total_splits][h_kv][q_rows]
    const float* o_accum;         // [total_splits][h_kv][q_rows][512]
    void* o;                      // [batch][q_rows][h_kv][512], q's dtype
    float* lse;                   // [batch][h_q][s_q]
    int* error;                   // ErrorRecord, or null
    const float* attn_sink;       // [h_q] or null
    int batch;
    int q_rows;
    int h_kv;
    int heads_per_kv;
    int s_q;
    int h_q;
    int max_splits;               // upper bound on any request's splits (num_sm_parts)
    int total_splits;             // rows of lse_accum / o_accum
    int sparse_s_q;               // query tokens folded into the request axis (dense: 1)
};

// Tile-scheduler (metadata) kernel.
struct MetadataParams {
    const int* seqlens;           // [batch]
    int* sched_meta;              // [num_sm_parts][8]
    int* num_splits;              // [batch + 1]
    int* error;                   // ErrorRecord, or null
    int batch;
    int block_n;
    int fixed_overhead_blocks;
    int num_sm_parts;
    int uniform_seqlen;           // >= 0: every request has this length (sparse: topk), seqlens unread;
                                  // -1: dense. Written into every part's slot 5 (the call checks it)
};

#if !defined(FLASHMLA_SPLITKV_PARAMS_BYTES) || !defined(FLASHMLA_COMBINE_PARAMS_BYTES) || \
    !defined(FLASHMLA_METADATA_PARAMS_BYTES)
#error "compile through flashmla_cupy (it defines the host-side parameter sizes)"
#endif
static_assert(sizeof(SplitKVParams) == FLASHMLA_SPLITKV_PARAMS_BYTES, "SplitKVParams: host and device layouts differ");
static_assert(sizeof(CombineParams) == FLASHMLA_COMBINE_PARAMS_BYTES, "CombineParams: host and device layouts differ");
static_assert(sizeof(MetadataParams) == FLASHMLA_METADATA_PARAMS_BYTES, "MetadataParams: host and device layouts differ");

}  // namespace flashmla
