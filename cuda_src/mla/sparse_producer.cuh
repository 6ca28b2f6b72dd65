// The sparse kernel's producer warpgroup: DeepSeek-V3.2's FP8 cache, gathered by token id.
//
// A "page" of the sparse kernel is 64 consecutive entries of one query token's index list. For
// each page the producer reads the 64 token ids, loads each valid token's 656 bytes (512 e4m3
// NoPE values, 4 float32 scales, 64 bf16 RoPE values), dequantizes the NoPE part to fp16 and
// stores everything into a page buffer exactly as TMA stores a dense page (nine 64 x 64 tiles,
// 128-byte swizzle), so the consumers' WGMMAs are the dense kernel's. Skipped entries (id < 0, id
// outside the cache, position past topk_length) get zero rows and a 0 bit in token_valid.
//
// Hand-off per page buffer and tile group (tiles 0-3 = V's left half, 4-8 = the rest): wait for
// the consumers' release (bar_free, one arrival per refill), fill, then one arrival per producer
// warp on each of the group's full barriers (bar_kv). Buffer 0 is filled left group first, buffer
// 1 right group first: the order in which warpgroups 0 and 1 read them.
//
// Lanes: each warp owns 16 tokens of the page, in two rounds of 8; lane = token (lane % 8) x part
// (lane / 8), and part j moves 16-byte chunks j, j + 4, ... of its token's row, so that one
// warp-wide store writes 4 chunks into each of 8 swizzled rows without bank conflicts.
#pragma once
#include <cuda/std/cstdint>

#include "common/sync.cuh"
#include "mla/config.cuh"
#include "mla/params.cuh"

namespace flashmla {

__device__ __forceinline__ uint4 load_token_chunk(const uint8_t* ptr) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

__device__ __forceinline__ float2 load_scale_pair(const uint8_t* ptr) {
    float2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(ptr));
    return v;
}

// 16 bytes global -> shared without registers; `valid` false writes zeros and reads nothing.
__device__ __forceinline__ void copy_chunk_async(void* dst, const uint8_t* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// Two e4m3 values (a 16-bit word) -> fp16x2, times `scale2` (fp16x2).
__device__ __forceinline__ uint32_t dequant_pair(uint32_t two_fp8, uint32_t scale2) {
    uint32_t h, out;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(static_cast<unsigned short>(two_fp8)));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(h), "r"(scale2));
    return out;
}

__device__ __forceinline__ uint32_t fp16x2_splat(float x) {
    uint32_t out;
    asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(out) : "f"(x));
    return out;
}

template <typename T>
struct SparseProducer {
    const SplitKVParams& p;
    typename T::SharedStorage& st;
    const int warp, lane;                 // warp within the producer warpgroup
    uint32_t free_phase = 0;              // bit 2 * buf + group: parity of the next bar_free wait

    __device__ __forceinline__ SparseProducer(const SplitKVParams& params, typename T::SharedStorage& storage)
        : p(params), st(storage), warp((threadIdx.x / 32) % 4), lane(threadIdx.x % 32) {}

    // Byte offset of 16-byte chunk `chunk` (of 8) of row `row` in a 128-byte-swizzled 64 x 64 tile.
    __device__ __forceinline__ static uint32_t swizzled(int row, int chunk) {
        return row * 128 + ((chunk ^ (row % 8)) * 16);
    }

    __device__ __forceinline__ unsigned char* chunk_address(int buf, int tile, int row, int chunk) const {
        return reinterpret_cast<unsigned char*>(st.kv[buf]) + tile * (64 * kTileCols * 2) + swizzled(row, chunk);
    }

    __device__ __forceinline__ void store_chunk(int buf, int tile, int row, int chunk, uint4 v) const {
        *reinterpret_cast<uint4*>(chunk_address(buf, tile, row, chunk)) = v;
    }

    // 16 e4m3 values of `token` (NoPE bytes 16k .. 16k + 15) -> fp16 chunks 2j, 2j + 1 of `tile`.
    __device__ __forceinline__ void store_nope(int buf, int tile, int row, int j, uint4 raw, uint32_t scale2) const {
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t h[8];
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
            h[2 * i] = dequant_pair(w[i] & 0xffffu, scale2);
            h[2 * i + 1] = dequant_pair(w[i] >> 16, scale2);
        }
        store_chunk(buf, tile, row, 2 * j, make_uint4(h[0], h[1], h[2], h[3]));
        store_chunk(buf, tile, row, 2 * j + 1, make_uint4(h[4], h[5], h[6], h[7]));
    }

    // Tiles of group kGroup (0: NoPE columns 0-255; 1: NoPE 256-511 and RoPE) for this warp's
    // tokens, whose byte offsets in the cache lanes 0-15 hold (-1: skipped). The group is a
    // template argument so that the scales stay in registers (a runtime index would put them in
    // local memory); the RoPE chunks are bf16 already and go to shared memory by cp.async,
    // without registers (zeros for a skipped token).
    template <int kGroup>
    __device__ __forceinline__ void fill_group(int buf, int64_t offset) const {
        const int part = lane / 8;
        CUTE_UNROLL
        for (int round = 0; round < 2; ++round) {
            const int token = round * 8 + lane % 8;
            const int row = warp * 16 + token;
            const int64_t off = __shfl_sync(0xffffffffu, offset, token);
            const bool valid = off >= 0;
            const uint8_t* src = p.cache + (valid ? off : 0);
            if constexpr (kGroup == 1) {
                CUTE_UNROLL
                for (int c = 0; c < 2; ++c) {
                    copy_chunk_async(chunk_address(buf, kTilesK - 1, row, part + 4 * c),
                                     src + kFp8RopeOffset + 16 * (part + 4 * c), valid);
                }
            }
            const uint4 zero = make_uint4(0, 0, 0, 0);
            uint4 raw[4];
            CUTE_UNROLL
            for (int i = 0; i < 4; ++i) {
                raw[i] = valid ? load_token_chunk(src + 16 * (kGroup * 16 + part + 4 * i)) : zero;
            }
            const float2 scales = valid ? load_scale_pair(src + kHeadDimV + 8 * kGroup) : make_float2(0.0f, 0.0f);
            CUTE_UNROLL
            for (int i = 0; i < 4; ++i) {
                // chunk k = 16 kGroup + part + 4i covers NoPE values 16k ..; its scale is k / 8
                store_nope(buf, kGroup * 4 + i, row, part, raw[i], fp16x2_splat(i < 2 ? scales.x : scales.y));
            }
        }
        if constexpr (kGroup == 1) cp_async_wait_all();
    }

    // Page `page` of the index list `ids` (valid entries: the first `visible`) into buffer `buf`.
    __device__ __forceinline__ void fill_page(const int* ids, int page, int visible, int buf) {
        const int t = page * kPageBlock + warp * 16 + lane % 16;
        const int id = t < visible ? ids[t] : -1;
        const bool valid = id >= 0 && id < p.cache_tokens;
        const int64_t offset = valid ? (int64_t)(id / p.page_block_size) * p.cache_block_stride +
                                       (int64_t)(id % p.page_block_size) * kFp8TokenBytes
                                     : -1;
        const uint32_t bits = __ballot_sync(0xffffffffu, valid) & 0xffffu;
        CUTE_UNROLL
        for (int n = 0; n < 2; ++n) {
            const int group = buf == 0 ? n : 1 - n;
            const int slot = 2 * buf + group;
            mbarrier_wait(smem_u32(&st.bar_free[buf][group]), (free_phase >> slot) & 1);
            free_phase ^= 1u << slot;
            if (n == 0 && lane == 0) st.token_valid[buf][warp] = static_cast<uint16_t>(bits);
            if (group == 0) {
                fill_group<0>(buf, offset);
            } else {
                fill_group<1>(buf, offset);
            }
            fence_smem_for_async_proxy();           // the consumers' WGMMAs read these stores
            __syncwarp();
            if (lane == 0) {
                const int first = group == 0 ? 0 : 4, last = group == 0 ? 4 : kTilesK;
                for (int tile = first; tile < last; ++tile) mbarrier_arrive(smem_u32(&st.bar_kv[buf][tile]));
            }
        }
    }
};

}  // namespace flashmla
