// Kernel parameters of the minimal FlashAttention forward: the one place where device and host
// meet for it.
//
// flashmla_cupy/attention.py mirrors the struct field by field (ctypes), in the same order; the
// program is compiled with the size the host computed, checked below, so that a drift between the
// two sides fails the compile rather than the launch. One field per line.
#pragma once
#include <cuda/std/cstdint>

namespace flashmla {

struct FlashAttnMinimalParams {
    const float* q;               // [batch][heads][seqlen][head_dim], contiguous
    const float* k;               // [batch][heads][seqlen][head_dim], contiguous
    const float* v;               // [batch][heads][seqlen][head_dim], contiguous
    float* out;                   // [batch][heads][seqlen][head_dim]
    float* lse;                   // [batch][heads][seqlen], natural log
    int heads;
    int seqlen;
    int head_dim;                 // 1 .. 128
    int causal;                   // 1: query i sees keys j <= i
    float softmax_scale;
};

#if !defined(FLASHMLA_ATTN_MINIMAL_PARAMS_BYTES)
#error "compile through flashmla_cupy (it defines the host-side parameter size)"
#endif
static_assert(sizeof(FlashAttnMinimalParams) == FLASHMLA_ATTN_MINIMAL_PARAMS_BYTES,
              "FlashAttnMinimalParams: host and device layouts differ");

}  // namespace flashmla
