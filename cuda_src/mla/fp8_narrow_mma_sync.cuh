// The narrow kernel's form for at most 16 query rows (one m16 tile): mma.sync m16n8k16, fp16 in,
// fp32 out, with both operands in registers, so the consumer warps convert the staged e4m3 bytes
// straight into fragments (fp8_narrow_kernel.cu has the kernel around it).
//
// Per page: S = Q K^T, warp w for tokens 16w..16w+15 (two n8 tiles); the page's row max over the
// four warps (shared memory and a named barrier), P = exp2(S - max) in fp16 into shared memory, a
// second barrier; O += P V, warp w for O's columns 128w..128w+127, P by ldmatrix.
//
// Fragment layouts. The reduction dimensions are permuted so that each thread's operands are
// contiguous bytes. QK^T: quad lane c takes dims 16c..16c+15 of each 64, four per k-step (one
// 16-byte load per token and 64 dims; Q's fragment, one 16-byte load per k-step). P V: n8 tile
// j = 4g + s of warp w holds O's columns 128w + 32g + 4n + s (n = lane / 4), so a thread reads one
// 32-bit word per token for four tiles and owns 8 contiguous output columns. Column n of QK^T's n8
// tile t is token 16w + 8t + n / 2 + 4 (n % 2): the rows a quarter warp loads are 4 apart, on
// other banks under the 128-byte swizzle.
#pragma once
#include "mla/fp8_narrow_common.cuh"

namespace flashmla {

// D += A B, m16n8k16, fp16 operands, fp32 accumulators (PTX's fragment layouts).
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void store_shared_u16(uint32_t dst, uint16_t v) {
    asm volatile("st.shared.u16 [%0], %1;" :: "r"(dst), "h"(v) : "memory");
}

__device__ __forceinline__ uint16_t to_fp16(float x) {
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

struct NarrowMmaSyncRows : NarrowConsumerBase {
    using Base = NarrowConsumerBase;
    static constexpr int kRows = kFp8NarrowMmaSyncRows;
    static_assert(kRows == 16, "one m16 tile of query rows");
    static constexpr int kRowsPerThread = 2;       // row halves h: rows quad_row + 8h of the tile

    // The current request: this warp's 16 rows x 128 columns of O, and per row half the running
    // max (log2; alike in the four warps), this thread's share of the sum, and the causal border
    // (tokens at or past it are masked).
    float o[16][4];
    float row_max[2];
    float row_sum[2];
    int border[2];

    __device__ __forceinline__ NarrowMmaSyncRows(const SplitKVParams& params, NarrowStorage& storage)
        : Base(params, storage) {}

    __device__ __forceinline__ int row_of(int half) const { return quad_row + 8 * half; }

    __device__ __forceinline__ void begin_request(const RequestSpan& span) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            row_max[h] = -kInf;
            row_sum[h] = 0.0f;
            border[h] = span.seqlen - (p.causal ? causal_mask_len(p, 0, row_of(h)) : 0);
        }
        #pragma unroll
        for (int j = 0; j < 16; ++j) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) o[j][i] = 0.0f;
        }
    }

    // Q's A fragments, fp16, each where scores() loads it with one 16-byte load: for 64-dim block
    // blk and k-step kk, lane l's words {row r, row r + 8} x {dims 16c + 4kk + {0, 1}, + {2, 3}}
    // (r = l / 4, c = l % 4). Assembled from Q's rows at every page they cost ~144 register moves
    // a page (docs/perf-notes.md section 28). They lie in rows 16..31 of tile blk, TMA's zeros here.
    static_assert(4 * 32 * 16 == kRows * kSwizzleRowBytes && 2 * kRows <= 64, "a tile's fragments fill its rows 16..31");
    __device__ __forceinline__ uint32_t q_fragment(int blk, int kk, int l) const {
        return smem_u32(st.q) + blk * kFp16TileBytes + kRows * kSwizzleRowBytes + (32 * kk + l) * 16;
    }

    // Q's fragments from the first 16 rows of every tile (bf16 -> fp16).
    __device__ __forceinline__ void prepare_q() const {
        constexpr int kFragments = kTilesK * 4 * 32;
        for (int i = threadIdx.x; i < kFragments; i += kConsumerThreads) {
            const int blk = i / 128, kk = i / 32 % 4, l = i % 32;
            const uint32_t tile = smem_u32(st.q) + blk * kFp16TileBytes;
            uint32_t w[2][2];                                         // [row half][dims + {0, 1}, + {2, 3}]
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint4 v = load_shared(swizzled_chunk(tile, l / 4 + 8 * h, 2 * (l % 4) + kk / 2));
                w[h][0] = bf16x2_to_fp16x2(word_of(v, 2 * (kk % 2)));
                w[h][1] = bf16x2_to_fp16x2(word_of(v, 2 * (kk % 2) + 1));
            }
            store_shared(q_fragment(blk, kk, l), make_uint4(w[0][0], w[1][0], w[0][1], w[1][1]));
        }
        sync_consumers(NarrowBarrier::kQReady);
    }

    template <bool kMasked>
    __device__ __forceinline__ void page_step(uint32_t page, int first_token, int valid) {
        float s[2][4];
        scores(page, s);
        softmax<kMasked>(s, first_token);
        values<kMasked>(page, valid);
    }

    // S = Q K^T for this warp's 16 tokens of the staged page at `page`. Each tile's sum over the
    // 576 dims runs as kScoreChains chains (its 36 k-steps in turn), added at the end: with one
    // chain a tile, each of its 36 mma.sync waited for the one before (perf-notes section 29).
    static constexpr int kScoreChains = 3;
    __device__ __forceinline__ void scores(uint32_t page, float (&s)[2][4]) const {
        const int token = 16 * warp + (quad_row >> 1) + 4 * (quad_row & 1);   // of n8 tile 0 (+8 for tile 1)
        float part[2][kScoreChains][4];                             // [tile][chain]
        #pragma unroll
        for (int t = 0; t < 2; ++t) {
            #pragma unroll
            for (int c = 0; c < kScoreChains; ++c) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) part[t][c][i] = 0.0f;
            }
        }
        #pragma unroll
        for (int blk = 0; blk < kTilesK; ++blk) {                   // 64 dims: box blk / 2, bytes 64 (blk % 2)..
            const uint32_t box = page + (blk / 2) * kStagedBoxBytes;
            uint4 k[2];
            #pragma unroll
            for (int t = 0; t < 2; ++t) k[t] = load_shared(swizzled_chunk(box, token + 8 * t, (blk % 2) * 4 + quad));
            #pragma unroll
            for (int kk = 0; kk < 4; ++kk) {                         // dims 16c + 4kk .. + 3
                const uint4 q = load_shared(q_fragment(blk, kk, lane));
                const uint32_t a[4] = {q.x, q.y, q.z, q.w};
                #pragma unroll
                for (int t = 0; t < 2; ++t) {
                    const Fp16x2Pair b = e4m3x4_to_fp16x2(word_of(k[t], kk));
                    mma_16816(part[t][(4 * blk + kk) % kScoreChains], a, b.lo, b.hi);
                }
            }
        }
        #pragma unroll
        for (int t = 0; t < 2; ++t) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                s[t][i] = part[t][0][i];
                #pragma unroll
                for (int c = 1; c < kScoreChains; ++c) s[t][i] += part[t][c][i];
            }
        }
    }

    // The online softmax of one page (`first_token`: its first token of the request): scales and
    // masks S, agrees on the row max with the other warps, rescales O and the sums, and
    // stores P. The running max moves only when the page's passes it by more than 2^8 (P <= 2^8
    // in fp16), so after the first pages the factors are exactly 1 and O is left alone.
    template <bool kMasked>
    __device__ __forceinline__ void softmax(float (&s)[2][4], int first_token) {
        const int parity = buffer();
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = -kInf;
            #pragma unroll
            for (int t = 0; t < 2; ++t) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = s[t][2 * h + e] * scale_log2;
                    if constexpr (kMasked) {
                        if (first_token + 16 * warp + 8 * t + quad + 4 * e >= border[h]) x = -kInf;
                    }
                    s[t][2 * h + e] = x;
                    mx = fmaxf(mx, x);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            if (quad == 0) st.page_max[group][parity][warp][row_of(h)] = mx;
        }
        sync_group(NarrowBarrier::kPageMax);
        bool rescale = false;
        float factor[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = st.page_max[group][parity][0][row_of(h)];
            #pragma unroll
            for (int w = 1; w < kNarrowWarps; ++w) mx = fmaxf(mx, st.page_max[group][parity][w][row_of(h)]);
            const float old = row_max[h];
            const float now = mx > old + 8.0f ? mx : old;            // -inf + 8 = -inf: the first visible page moves it
            factor[h] = now == old ? 1.0f : exp2_approx(old - now);
            rescale |= now != old;
            row_max[h] = now;
            row_sum[h] *= factor[h];
        }
        if (__any_sync(0xffffffffu, rescale)) {
            #pragma unroll
            for (int j = 0; j < 16; ++j) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) o[j][i] *= factor[i / 2];
            }
        }
        const uint32_t p_buf = smem_u32(st.p[group][parity]);
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float m = row_max[h] == -kInf ? 0.0f : row_max[h];
            #pragma unroll
            for (int t = 0; t < 2; ++t) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pv = exp2_approx(s[t][2 * h + e] - m);
                    row_sum[h] += pv;
                    // token 16w + 8t + c + 4e: chunk 2w + t of P's row, element c + 4e
                    store_shared_u16(swizzled_chunk(p_buf, row_of(h), 2 * warp + t) + 2 * (quad + 4 * e), to_fp16(pv));
                }
            }
        }
        sync_group(NarrowBarrier::kPReady);
    }

    // O += P V for this warp's 128 columns (`valid`: the page's tokens before the request's end;
    // kMasked: V of the others is taken as 0, whatever their bytes hold).
    template <bool kMasked>
    __device__ __forceinline__ void values(uint32_t page, int valid) {
        const uint32_t p_buf = smem_u32(st.p[group][buffer()]);
        const uint32_t box = page + warp * kStagedBoxBytes;           // columns 128w.. are box w's bytes
        const int matrix = lane / 8;                                  // ldmatrix: rows +8 (odd), tokens +8 (2, 3)
        const int p_row = (matrix % 2) * 8 + lane % 8;
        #pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) {
            uint32_t a[4];
            ldmatrix_x4(a, swizzled_chunk(p_buf, p_row, 2 * ks + matrix / 2));
            const int token = 16 * ks + 2 * quad;                     // and + 1, + 8, + 9
            #pragma unroll
            for (int g = 0; g < 4; ++g) {
                uint32_t w[4];
                #pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int tk = token + (r % 2) + 8 * (r / 2);
                    w[r] = load_shared_u32(swizzled_chunk(box, tk, 2 * g + quad_row / 4) + 4 * (quad_row % 4));
                    if constexpr (kMasked) w[r] = tk < valid ? w[r] : 0u;
                }
                // pairs (token, token + 1) of each column's byte: columns s = 0, 1 and 2, 3
                const Fp16x2Pair c01 = e4m3x4_to_fp16x2(byte_perm(w[0], w[1], 0x5140));
                const Fp16x2Pair c23 = e4m3x4_to_fp16x2(byte_perm(w[0], w[1], 0x7362));
                const Fp16x2Pair c01_8 = e4m3x4_to_fp16x2(byte_perm(w[2], w[3], 0x5140));
                const Fp16x2Pair c23_8 = e4m3x4_to_fp16x2(byte_perm(w[2], w[3], 0x7362));
                const uint32_t b0[4] = {c01.lo, c01.hi, c23.lo, c23.hi};
                const uint32_t b1[4] = {c01_8.lo, c01_8.hi, c23_8.lo, c23_8.hi};
                #pragma unroll
                for (int sub = 0; sub < 4; ++sub) mma_16816(o[4 * g + sub], a, b0[sub], b1[sub]);
            }
        }
    }

    // The rows' softmax sums: the quads', then the four warps' through shared memory.
    __device__ __forceinline__ void reduce_sums(float (&sums)[2]) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = row_sum[h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            if (quad == 0) st.row_sum[group][warp][row_of(h)] = l;
        }
        sync_group(NarrowBarrier::kSums);
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row_of(h);
            sums[h] = 0.0f;
            #pragma unroll
            for (int w = 0; w < kNarrowWarps; ++w) sums[h] += st.row_sum[group][w][row];
        }
    }

    __device__ __forceinline__ bool merge_groups(float (&sums)[2], bool& bad) {
        return Base::merge_groups(o, row_max, sums, bad, warp == 0 && quad == 0, [](int e) { return e / 2; },
                                  [this](int h) { return row_of(h); });
    }

    // O / sum (times k_scale) and lse of the request's rows.
    __device__ __forceinline__ void store(const NarrowOutput& out, const float (&sums)[2]) const {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int q_row = row_of(h);
            if (q_row >= out.rows) continue;
            const float factor = row_factor(out, sums[h]);
            #pragma unroll
            for (int g = 0; g < 4; ++g) {
                float v[8];
                #pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = o[4 * g + e % 4][2 * h + e / 4] * factor;
                write_columns(out, q_row, 128 * warp + 32 * g + 8 * quad, v);
            }
            if (warp == 0 && quad == 0) write_lse(out, q_row, sums[h], row_max[h]);
        }
    }
};

}  // namespace flashmla
