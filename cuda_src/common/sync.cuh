// Shared-memory barriers and accesses on 32-bit shared addresses.
//
// NVRTC gives generic pointers to shared memory 64 bits; converting once to a 32-bit shared
// address and passing that around keeps the hot loops' address arithmetic in single registers.
#pragma once
#include <cuda/std/cstdint>

namespace flashmla {

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ uint4 load_shared(uint32_t src) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(src)
                 : "memory");
    return v;
}

__device__ __forceinline__ uint32_t load_shared_u32(uint32_t src) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(src) : "memory");
    return v;
}

__device__ __forceinline__ void store_shared(uint32_t dst, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" :: "r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ void store_shared_u32(uint32_t dst, uint32_t v) {
    asm volatile("st.shared.b32 [%0], %1;" :: "r"(dst), "r"(v) : "memory");
}

// Four 8 x 8 matrices of 16-bit elements (ldmatrix / stmatrix): lane l gives the address of row
// l % 8 of matrix l / 8, and holds in r[m] elements 2 (l % 4) and 2 (l % 4) + 1 of row l / 4 of
// matrix m (_trans: of its column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// The thread index, read here (volatile): the compiler can then neither hoist what is computed
// from it out of a loop nor keep the value from the kernel's prologue live (or spilled) up to
// here. The FP8 kernels have no register to spare after their warpgroups' register split: NVRTC
// 13.5 spilled an output row of the dense kernel's epilogue and the dense expander's thread index
// (13.0, reading only in store_o, one of the sparse epilogue's).
__device__ __forceinline__ int thread_index_here() {
    int tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return tid;
}

// blockIdx.z, read here (volatile), for the same reason.
__device__ __forceinline__ int block_index_z_here() {
    int z;
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    return z;
}

// `ptr`, as a value the compiler cannot see through: what is computed from it (WGMMA
// descriptors) is computed here, not hoisted out of the page loop around it and kept live there,
// where the FP8 kernels have no register to spare.
template <typename E>
__device__ __forceinline__ E* computed_here(E* ptr) {
    asm volatile("" : "+l"(ptr));
    return ptr;
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

// `bytes` of the current phase's expected transaction bytes accounted for by this thread (bytes
// it copies itself, with cp.async, where TMA would have completed them).
__device__ __forceinline__ void mbarrier_complete_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.complete_tx.shared::cta.relaxed.cta.b64 [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

// Have L2 fetch the 128-byte line at `ptr`: nothing to wait for, no registers held; the loads that
// follow a page or two later hit L2.
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(ptr));
}

// --- cp.async (16-byte copies from global to shared memory, issued per thread) --------------

// 16 bytes at `src` into shared `dst`; with `src_bytes` 0, zeros and nothing read.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// An arrival on `bar` once this thread's cp.async copies so far have landed; the barrier's count
// includes it (.noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
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

// --- clusters (the sparse kernel's pair of CTAs sharing dequantized pages) --------------------

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ uint32_t cluster_size() {
    uint32_t n;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}

// The shared::cluster address of the same byte in CTA `rank`'s shared memory.
__device__ __forceinline__ uint32_t peer_address(uint32_t local, uint32_t rank) {
    uint32_t out;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(local), "r"(rank));
    return out;
}

// An arrival on another CTA's mbarrier (a shared::cluster address).
__device__ __forceinline__ void mbarrier_arrive_peer(uint32_t peer_bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(peer_bar) : "memory");
}

// `bytes` (a multiple of 16) of this CTA's shared memory at `src` into another CTA's at
// `peer_dst`, by the bulk-copy engine; its mbarrier `peer_bar` counts them as transaction bytes
// (the receiver announced them with expect_tx). The source was written by ordinary stores: fence
// them for the async proxy first (fence_smem_for_async_proxy, by the threads that wrote).
__device__ __forceinline__ void copy_to_peer_async(uint32_t peer_dst, uint32_t src, uint32_t bytes, uint32_t peer_bar) {
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(peer_dst), "r"(src), "r"(bytes), "r"(peer_bar) : "memory");
}

// Every thread of every CTA of the cluster (a launch without clusters is a cluster of one CTA).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
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
