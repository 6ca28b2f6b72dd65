// Tensor Memory Accelerator: bulk tensor copies described by tensor maps that the host encodes
// (cuTensorMapEncodeTiled in flashmla_cupy/tma.py) and passes inside __grid_constant__ params.
#pragma once
#include <cuda/std/cstdint>

namespace flashmla {

// Opaque CUtensorMap: 128 bytes, 64-byte aligned (the driver header is not used on the device).
struct alignas(64) TensorMap {
    unsigned char bytes[128];
};

// TMA's 128-byte swizzle, the layout of every shared-memory tile and staged box: rows of 128
// bytes, 16-byte chunk `chunk` of row `row` at chunk position chunk ^ (row % 8). The shared
// address of that chunk in the tile or box at `base`.
constexpr int kSwizzleRowBytes = 128;

__device__ __forceinline__ uint32_t swizzled_chunk(uint32_t base, int row, int chunk) {
    return base + row * kSwizzleRowBytes + ((chunk ^ (row % 8)) * 16);
}

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

}  // namespace flashmla
