// Tensor Memory Accelerator: bulk tensor copies described by tensor maps that the host encodes
// (cuTensorMapEncodeTiled in flashmla_cupy/tma.py) and passes inside __grid_constant__ params.
#pragma once
#include <cuda/std/cstdint>

namespace flashmla {

// Opaque CUtensorMap: 128 bytes, 64-byte aligned (the driver header is not used on the device).
struct alignas(64) TensorMap {
    unsigned char bytes[128];
};

// L2 cache policies for the .L2::cache_hint operand (the values of CUTLASS's CacheHintSm90).
enum class L2Hint : uint64_t {
    kEvictNormal = 0x1000000000000000ull,
    kEvictFirst = 0x12F0000000000000ull,
    kEvictLast = 0x14F0000000000000ull,
};

__device__ __forceinline__ void tma_prefetch_descriptor(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Load one box at coordinates (c0 innermost .. c3) into shared memory at `dst`;
// completion is signalled on the mbarrier `bar` as transaction bytes.
__device__ __forceinline__ void tma_load_4d(const TensorMap* map, uint32_t bar, uint32_t dst,
                                            int c0, int c1, int c2, int c3, L2Hint hint) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;"
        :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar),
           "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(static_cast<uint64_t>(hint))
        : "memory");
}

// Store one box from shared memory; boxes reaching past the tensor's bounds are clipped.
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, uint32_t src,
                                             int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
        :: "l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// Plain bulk copy shared -> global (`bytes` a multiple of 16, both addresses 16-byte aligned).
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(reinterpret_cast<uint64_t>(dst)), "r"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Wait until the committed bulk stores have finished reading shared memory.
__device__ __forceinline__ void bulk_wait_smem_reads() {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

}  // namespace flashmla
