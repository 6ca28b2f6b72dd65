// The error record: the first bad argument value a kernel finds, for the host to report.
//
// The record lives in mapped pinned host memory (flashmla_cupy/errors.py); the host reads it
// without synchronizing. Layout (int32): [code, claimed, index0, index1, value, bound, -, -].
// The first thread to claim the record fills it and publishes `code` last, so that a host that
// sees a code also sees the fields. Codes are FLASHMLA_ERROR_* (flashmla_cupy/constants.py).
#pragma once

namespace flashmla {

__device__ __noinline__ void report_error(int* record, int code, int index0, int index1, int value, int bound) {
    if (record == nullptr || atomicCAS(record + 1, 0, 1) != 0) return;
    volatile int* r = record;
    r[2] = index0;
    r[3] = index1;
    r[4] = value;
    r[5] = bound;
    __threadfence_system();
    r[0] = code;
}

}  // namespace flashmla
