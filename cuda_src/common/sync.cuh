// Shared-memory barriers on 32-bit shared addresses.
//
// NVRTC gives generic pointers to shared memory 64 bits; converting once to a 32-bit shared
// address and passing that around keeps the hot loops' address arithmetic in single registers.
#pragma once
#include <cuda/std/cstdint>

namespace flashmla {

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// --- mbarrier (transaction barriers that TMA loads complete) ---------------------------------

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrive_count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(arrive_count));
}

// Make initialized barriers visible to the async (TMA) proxy before first use.
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also announces how many bytes the current phase still expects.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(bytes) : "memory");
}

// A plain arrival (a thread that filled shared memory itself, or released a buffer).
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// Spin until the phase with parity `phase` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t phase) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" :: "r"(bar), "r"(phase) : "memory");
}

// --- named barriers among a subset of the block's warps (id 0 is __syncthreads) ---------------

__device__ __forceinline__ void named_barrier_sync(int id, int num_threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(num_threads) : "memory");
}

// The producer's half of a hand-off: the consumer's bar.sync on the same id sees every write
// made before this.
__device__ __forceinline__ void named_barrier_arrive(int id, int num_threads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(num_threads) : "memory");
}

// Ordinary shared-memory stores (st.shared, stmatrix) must be fenced before the async proxy
// (WGMMA operands) reads them or a TMA load overwrites them.
__device__ __forceinline__ void fence_smem_for_async_proxy() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Warp-specialized kernels: a warpgroup gives registers back (producer) or takes them (consumer).
template <int kRegs>
__device__ __forceinline__ void warpgroup_release_registers() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void warpgroup_claim_registers() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(kRegs));
}

}  // namespace flashmla
