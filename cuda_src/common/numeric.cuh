// Floating-point constants (NVRTC has no <cmath> macros such as INFINITY or M_LOG2E), exp2 on the
// SFU and the e4m3 conversions.
#pragma once
#include <cuda/std/cstdint>
#include <cuda/std/limits>

namespace flashmla {

constexpr float kInf = cuda::std::numeric_limits<float>::infinity();
constexpr float kNaN = cuda::std::numeric_limits<float>::quiet_NaN();
constexpr float kLog2e = 1.4426950408889634f;   // log2(e)
constexpr float kLn2 = 0.6931471805599453f;     // ln(2)

// 2^x on the SFU alone (ex2.approx.ftz). CUDA's exp2f wraps the same instruction in a fix-up for
// subnormal results (a compare and two multiplies, as without --use_fast_math), which on the
// softmax's path between two WGMMAs cost ~10% on compute-bound shapes; results below 2^-126
// become 0, which a softmax weight or a rescale factor cannot tell apart.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Four e4m3 values (a 32-bit word) -> the fp16x2 pairs of its low and high halves (exact). Each
// conversion reads its half in place (F2FP's .H1 operand for the high one): a shift fewer than
// converting `four >> 16` (docs/perf-notes.md section 28).
struct Fp16x2Pair {
    uint32_t lo, hi;
};
__device__ __forceinline__ Fp16x2Pair e4m3x4_to_fp16x2(uint32_t four_fp8) {
    Fp16x2Pair r;
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, lo;\n\tcvt.rn.f16x2.e4m3x2 %1, hi;\n\t}"
        : "=r"(r.lo), "=r"(r.hi) : "r"(four_fp8));
    return r;
}

// An fp16x2 pair -> two e4m3 values (round to nearest, saturating), in the low 16 bits.
__device__ __forceinline__ uint32_t fp16x2_to_e4m3x2(uint32_t pair) {
    uint16_t two;
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(two) : "r"(pair));
    return two;
}

__device__ __forceinline__ uint32_t fp16x2_mul(uint32_t a, uint32_t b) {
    uint32_t out;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(b));
    return out;
}

__device__ __forceinline__ uint32_t fp16x2_splat(float x) {
    uint32_t out;
    asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(out) : "f"(x));
    return out;
}

// Four floats -> four e4m3 values (round to nearest, saturating at +-448), a in the low byte.
__device__ __forceinline__ uint32_t f32x4_to_e4m3x4(float a, float b, float c, float d) {
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// Bytes of {b, a} picked by the selector's nibbles (prmt: a's bytes are 0-3, b's 4-7).
__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
}

// A bf16 pair -> fp16x2 (round to nearest; what fp16 cannot hold becomes inf or rounds to 0).
__device__ __forceinline__ uint32_t bf16x2_to_fp16x2(uint32_t pair) {
    const float lo = __uint_as_float(pair << 16), hi = __uint_as_float(pair & 0xffff0000u);
    uint32_t h;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(hi), "f"(lo));
    return h;
}

}  // namespace flashmla
