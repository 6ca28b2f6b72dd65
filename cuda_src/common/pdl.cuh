// Programmatic Dependent Launch, as inline PTX (CUDA's runtime wrappers are not declared under
// NVRTC). Both instructions are no-ops when the kernel was launched without the PDL attribute.
#pragma once

namespace flashmla {

// Block until the grids this one depends on have completed and their writes are visible.
// Nothing those grids produce may be read before this call (not even through __ldg).
__device__ __forceinline__ void pdl_wait_for_producers() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Allow the next kernel in the stream to start its prologue while this grid finishes.
__device__ __forceinline__ void pdl_allow_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace flashmla
