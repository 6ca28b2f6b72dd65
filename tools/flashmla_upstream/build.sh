#!/usr/bin/env bash
# Build libflashmla_up.so: FlashMLA upstream's own sm90 decoding kernels (dense and sparse FP8
# split-KV, combine, scheduler; compiled by nvcc with upstream's flags) behind the ctypes entry points of
# shim.cu, for side-by-side timing with `flashmla-cupy profile --baseline flash_mla` (see
# README.md). Needs nvcc 12.8+ and the nvidia-cutlass wheel (its CUTLASS/CuTe headers); no torch.
#
#   tools/flashmla_upstream/build.sh FLASHMLA_SRC [JOBS]
#
#   FLASHMLA_SRC  a checkout of github.com/deepseek-ai/FlashMLA at 9241ae3 (the last commit
#                 era that builds Hopper kernels; others may work if the files below exist)
#
# FLASHMLA_UP_OUT (the library's path) and FLASHMLA_UP_NVCC_FLAGS (more nvcc flags) serve
# timeline.py's stamped build.
set -euo pipefail
src=$(cd "$1" && pwd)
jobs=${2:-4}
here=$(cd "$(dirname "$0")" && pwd)
cutlass=$(${PYTHON:-python3} -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))")
cuda_include=$(dirname "$(command -v nvcc)")/../include
flags=(-O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES --expt-relaxed-constexpr --expt-extended-lambda
       --use_fast_math --ptxas-options=--register-usage-level=10 -lineinfo
       -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__
       -U__CUDA_NO_BFLOAT16_CONVERSIONS__ -gencode arch=compute_90a,code=sm_90a -Xcompiler -fPIC
       -I"$src/csrc" -I"$src/csrc/sm90" -I"$src/csrc/kerutils/include" -I"$cutlass/include"
       -I"$cutlass/tools/util/include" -I"$cuda_include/cccl" ${FLASHMLA_UP_NVCC_FLAGS:-})
out=${FLASHMLA_UP_OUT:-$here/libflashmla_up.so}
objs=$(mktemp -d)
trap 'rm -rf "$objs"' EXIT
units=("$src/csrc/sm90/decode/dense/instantiations/bf16.cu" "$src/csrc/sm90/decode/dense/instantiations/fp16.cu"
       "$src/csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu"
       "$src/csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu"
       "$src/csrc/smxx/decode/combine/combine.cu"
       "$src/csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu" "$here/shim.cu")
printf '%s\n' "${units[@]}" | xargs -P "$jobs" -I{} sh -c \
    'nvcc -c "$@" "{}" -o "'"$objs"'/$(basename "{}" .cu).o"' _ "${flags[@]}"
nvcc -shared -gencode arch=compute_90a,code=sm_90a -cudart static -o "$out" "$objs"/*.o
echo "built $out"
