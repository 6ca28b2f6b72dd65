// Floating-point constants (NVRTC has no <cmath> macros such as INFINITY or M_LOG2E).
#pragma once
#include <cuda/std/limits>

namespace flashmla {

constexpr float kInf = cuda::std::numeric_limits<float>::infinity();
constexpr float kNaN = cuda::std::numeric_limits<float>::quiet_NaN();
constexpr float kLog2e = 1.4426950408889634f;   // log2(e)
constexpr float kLn2 = 0.6931471805599453f;     // ln(2)

}  // namespace flashmla
