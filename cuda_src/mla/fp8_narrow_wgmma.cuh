// The narrow kernel's form for 17-32 query rows: WGMMA with the operands swapped, so that the
// cache is the register operand A and the query rows are N (fp8_narrow_kernel.cu has the kernel
// around it). mma.sync for two m16 tiles issues twice the instructions for the same FLOPs and
// ran no faster than the split-KV kernel (docs/perf-notes.md section 21); WGMMA takes A from
// registers, so the four consumer warps (one warpgroup) still convert the staged e4m3 bytes
// straight into fragments.
//
// Per page (64 tokens = M), for the 32 rows (N):
//   S^T = K Q^T: 36 m64n32k16 steps; A = K converted in registers, B = Q (fp16, permuted dims) in
//     shared memory; each batch of 2 k-steps converted while the previous one runs, each 64 dims'
//     bytes loaded while the 64 before them are multiplied;
//   the page's row max: over a warp's 16 tokens by shuffles, over the four warps through shared
//     memory (a named barrier); P^T = exp2(S^T - max) into shared memory as P (32 rows x 64,
//     stmatrix with transpose), a second barrier;
//   O^T += V^T P^T: 8 tiles of 64 of O's columns x 4 k-steps of 16 tokens; A = V converted in
//     registers, B = P.
//
// Fragment layouts (WGMMA's A: warp w holds rows 16w + r, r = lane / 4 and + 8, and k = 2 (lane %
// 4) + {0, 1} and + 8; accumulators: rows as A, columns 8j + 2 (lane % 4) + {0, 1}).
//   S^T's rows: row 16w + r + 8h is token 16w + (r ^ 4 (r % 2)) + 8h: the two rows of a quarter
//     warp (r = 2i, 2i + 1) are 5 apart, on other banks under the 128-byte swizzle, and so are
//     the four tokens a quarter warp reads for V (2c and (2c + 1) ^ 4). P's columns keep S^T's
//     row order, which P V's k index follows.
//   QK^T's reduction dims are permuted as in the mma.sync form: quad lane c takes dims 16c..16c+15
//     of each 64 (one 16-byte load per token), four per k-step; Q is stored permuted to match.
//   O^T's rows: row 16w + r + 8h of tile t is O's column 128w + 16r + 2t + h, so a thread converts
//     one 16-byte load per token (two tokens of a k-step paired by prmt) and owns 16 contiguous
//     columns of its 8 rows (8j + 2 (lane % 4) + {0, 1}).
#pragma once
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "mla/fp8_narrow_common.cuh"

namespace flashmla {

// A K-major operand in shared memory with the 128-byte swizzle, rows of 128 bytes, 8-row groups
// 1024 bytes apart; `addr` at a swizzle atom's row 0 plus the k-step's 32-byte offset.
__device__ __forceinline__ uint64_t sw128_k_major_desc(uint32_t addr) {
    cute::GmmaDescriptor desc;
    desc.bitfield.start_address_ = static_cast<uint16_t>(addr >> 4);
    desc.bitfield.leading_byte_offset_ = 1;                       // unused with the swizzle
    desc.bitfield.stride_byte_offset_ = 1024 >> 4;
    desc.bitfield.layout_type_ = static_cast<uint8_t>(cute::SM90::GMMA::LayoutType::B128);
    return desc.desc_;
}

// The descriptor of the operand `bytes` further on. The start address (16-byte units) is the low
// word's low 14 bits and shared addresses stay below 2^18, so one 32-bit add moves it: built
// afresh for each WGMMA, a descriptor took six uniform-datapath instructions (perf-notes §28).
__device__ __forceinline__ uint64_t advance_desc(uint64_t desc, uint32_t bytes) {
    const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
    return (desc & 0xffffffff00000000ull) | lo;
}

struct NarrowWgmmaRows : NarrowConsumerBase {
    using Base = NarrowConsumerBase;
    static constexpr int kRows = kFp8NarrowRows;
    static constexpr int kRowsPerThread = kRows / 4;   // i = 2j + e: row 8j + 2 quad + e
    using Mma = cute::SM90::GMMA::MMA_64x32x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
    static_assert(kRows == 32, "the MMA's N");

    // The current request: O^T's tiles (o[t][4j + 2h + e]: O's column first_column() + 2t + h of
    // row row_of(2j + e)), and per row the running max (log2; alike in the four warps), this
    // thread's share of the sum; its length (the rows' causal borders are worked out on the pages
    // that need them: eight of them in registers spilled).
    float o[kTilesV][16];
    float row_max[kRowsPerThread];
    float row_sum[kRowsPerThread];
    int seqlen;

    __device__ __forceinline__ NarrowWgmmaRows(const SplitKVParams& params, NarrowStorage& storage)
        : Base(params, storage) {}

    __device__ __forceinline__ int row_of(int i) const { return 8 * (i / 2) + 2 * quad + i % 2; }
    // The page's token of S^T's row 16 warp + quad_row + 8h.
    __device__ __forceinline__ int token_of(int h) const { return 16 * warp + (quad_row ^ ((quad_row & 1) << 2)) + 8 * h; }
    __device__ __forceinline__ int first_column() const { return 128 * warp + 16 * quad_row; }

    __device__ __forceinline__ void begin_request(const RequestSpan& span) {
        #pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            row_max[i] = -kInf;
            row_sum[i] = 0.0f;
        }
        seqlen = span.seqlen;
        #pragma unroll
        for (int t = 0; t < kTilesV; ++t) {
            #pragma unroll
            for (int i = 0; i < 16; ++i) o[t][i] = 0.0f;
        }
    }

    // The first 32 rows of every tile of Q, bf16 -> fp16 in place, each row's 64 dims permuted
    // into the k order of the K fragments: word 8kk + 4hi + c (k-step kk) holds dims
    // 16c + 4kk + 2hi + {0, 1}, i.e. the old word 8c + 2kk + hi.
    __device__ __forceinline__ void prepare_q() const {
        for (int i = threadIdx.x; i < kTilesK * kRows; i += kConsumerThreads) {
            const uint32_t tile = smem_u32(st.q) + (i / kRows) * kFp16TileBytes;
            const int row = i % kRows;
            uint4 in[8];
            #pragma unroll
            for (int c = 0; c < 8; ++c) in[c] = load_shared(swizzled_chunk(tile, row, c));
            #pragma unroll
            for (int chunk = 0; chunk < 8; ++chunk) {
                const int kk = chunk / 2, hi = chunk % 2;
                uint32_t w[4];
                #pragma unroll
                for (int c = 0; c < 4; ++c) w[c] = bf16x2_to_fp16x2(word_of(in[2 * c + kk / 2], 2 * (kk % 2) + hi));
                store_shared(swizzled_chunk(tile, row, chunk), make_uint4(w[0], w[1], w[2], w[3]));
            }
        }
        fence_smem_for_async_proxy();                             // WGMMA reads Q
        sync_consumers(NarrowBarrier::kQReady);
    }

    template <bool kMasked>
    __device__ __forceinline__ void page_step(uint32_t page, int first_token, int valid) {
        float s[16];
        scores(page, s);
        softmax<kMasked>(s, first_token);
        values<kMasked>(page, valid);
    }

    // S^T = K Q^T for the page's 64 tokens; returns with every WGMMA before it complete.
    __device__ __forceinline__ void scores(uint32_t page, float (&s)[16]) const {
        const int token = token_of(0);
        const uint64_t q = sw128_k_major_desc(smem_u32(computed_here(st.q)));   // its 36 descriptors not kept live
        auto load_k = [&](int blk, uint4 (&k)[2]) {                  // 64 dims: box blk / 2, bytes 64 (blk % 2)..
            const uint32_t box = page + (blk / 2) * kStagedBoxBytes;
            #pragma unroll
            for (int h = 0; h < 2; ++h) k[h] = load_shared(swizzled_chunk(box, token + 8 * h, (blk % 2) * 4 + quad));
        };
        uint4 k[2], k_next[2];
        load_k(0, k);
        #pragma unroll
        for (int blk = 0; blk < kTilesK; ++blk) {
            // The next 64 dims' bytes are loaded before this block's WGMMAs (the waits' memory
            // clobbers keep the compiler from moving loads above them): 3 % at 32 rows.
            // Loading V ahead the same way spilled (values).
            if (blk + 1 < kTilesK) load_k(blk + 1, k_next);
            #pragma unroll
            for (int pair = 0; pair < 2; ++pair) {                   // 2 k-steps a batch: fewer fragments live
                uint32_t a[2][4];
                #pragma unroll
                for (int i = 0; i < 2; ++i) {                        // dims 16c + 4kk .. + 3
                    const uint32_t w0 = word_of(k[0], 2 * pair + i), w1 = word_of(k[1], 2 * pair + i);
                    const Fp16x2Pair c0 = e4m3x4_to_fp16x2(w0), c1 = e4m3x4_to_fp16x2(w1);
                    a[i][0] = c0.lo;
                    a[i][1] = c1.lo;
                    a[i][2] = c0.hi;
                    a[i][3] = c1.hi;
                }
                fence_accumulators(s);
                cute::warpgroup_arrive();
                #pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int kk = 2 * pair + i;
                    mma(a[i], advance_desc(q, blk * kFp16TileBytes + 32 * kk), s, blk > 0 || kk > 0);
                }
                cute::warpgroup_commit_batch();
                cute::warpgroup_wait<1>();                            // the previous batch's fragments are free
            }
            #pragma unroll
            for (int h = 0; h < 2; ++h) k[h] = k_next[h];
        }
        cute::warpgroup_wait<0>();
        fence_accumulators(s);
    }

    // The online softmax of one page (`first_token`: its first token of the request), as in the
    // mma.sync form: scales and masks S^T, agrees on each row's max with the other warps, rescales
    // O and the sums when the max moves by more than 2^8, and stores P.
    template <bool kMasked>
    __device__ __forceinline__ void softmax(float (&s)[16], int first_token) {
        const int parity = buffer();
        float page_max[kRowsPerThread];
        #pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            float mx = -kInf;
            const int border = kMasked ? seqlen - (p.causal ? causal_mask_len(p, 0, row_of(i)) : 0) : 0;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int at = 4 * (i / 2) + 2 * h + i % 2;
                float x = s[at] * scale_log2;
                if constexpr (kMasked) {
                    if (first_token + token_of(h) >= border) x = -kInf;
                }
                s[at] = x;
                mx = fmaxf(mx, x);
            }
            #pragma unroll
            for (int mask = 4; mask < 32; mask *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, mask));
            page_max[i] = mx;
        }
        if (quad_row == 0) {
            #pragma unroll
            for (int j = 0; j < kRowsPerThread / 2; ++j) {
                *reinterpret_cast<float2*>(&st.page_max[group][parity][warp][row_of(2 * j)]) = make_float2(page_max[2 * j], page_max[2 * j + 1]);
            }
        }
        sync_group(NarrowBarrier::kPageMax);
        bool rescale = false;
        float factor[kRowsPerThread];
        #pragma unroll
        for (int j = 0; j < kRowsPerThread / 2; ++j) {
            float2 mx = *reinterpret_cast<const float2*>(&st.page_max[group][parity][0][row_of(2 * j)]);
            #pragma unroll
            for (int w = 1; w < kNarrowWarps; ++w) {
                const float2 other = *reinterpret_cast<const float2*>(&st.page_max[group][parity][w][row_of(2 * j)]);
                mx = make_float2(fmaxf(mx.x, other.x), fmaxf(mx.y, other.y));
            }
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = 2 * j + e;
                const float old = row_max[i];
                const float page = e == 0 ? mx.x : mx.y;
                const float now = page > old + 8.0f ? page : old;    // -inf + 8 = -inf: the first visible page moves it
                factor[i] = now == old ? 1.0f : exp2_approx(old - now);
                rescale |= now != old;
                row_max[i] = now;
                row_sum[i] *= factor[i];
            }
        }
        if (__any_sync(0xffffffffu, rescale)) {                       // the last P V is complete (values waited)
            #pragma unroll
            for (int t = 0; t < kTilesV; ++t) {
                #pragma unroll
                for (int at = 0; at < 16; ++at) o[t][at] *= factor[2 * (at / 4) + at % 2];
            }
        }
        uint32_t packed[kRowsPerThread / 2][2];                       // [j][h]: rows 8j + 2 quad + {0, 1}
        #pragma unroll
        for (int j = 0; j < kRowsPerThread / 2; ++j) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                float pv[2];
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int i = 2 * j + e;
                    pv[e] = exp2_approx(s[4 * j + 2 * h + e] - (row_max[i] == -kInf ? 0.0f : row_max[i]));
                    row_sum[i] += pv[e];
                }
                packed[j][h] = pack_fp16x2(pv[0], pv[1]);
            }
        }
        // stmatrix.trans: matrix m = lane / 8 of call x is (h = m % 2, j = 2x + m / 2); its stored row
        // lane % 8 is P's row 8j + lane % 8, columns 16 warp + 8h .. + 7.
        const uint32_t p_buf = smem_u32(st.p[group][parity]);
        const int m = lane / 8;
        #pragma unroll
        for (int x = 0; x < 2; ++x) {
            const uint32_t dst = swizzled_chunk(p_buf, 8 * (2 * x + m / 2) + lane % 8, 2 * warp + m % 2);
            stmatrix_x4_trans(dst, packed[2 * x][0], packed[2 * x][1], packed[2 * x + 1][0], packed[2 * x + 1][1]);
        }
        fence_smem_for_async_proxy();                                 // WGMMA reads P
        sync_group(NarrowBarrier::kPReady);
    }

    // O^T += V^T P^T (`valid`: the page's tokens before the request's end; kMasked: V of the others
    // is taken as 0, whatever their bytes hold). Returns with every WGMMA complete: the softmax
    // may rescale O (with one batch left in flight, ptxas serialized all WGMMAs).
    template <bool kMasked>
    __device__ __forceinline__ void values(uint32_t page, int valid) {
        const uint64_t p_desc = sw128_k_major_desc(smem_u32(st.p[group][buffer()]));
        const uint32_t box = page + warp * kStagedBoxBytes;           // columns 128w.. are box w's bytes
        #pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks) {
            // k = 2 quad, 2 quad + 1 (+ 8): S^T's rows 16 ks + those, i.e. these tokens
            const int tokens[4] = {16 * ks + 2 * quad, 16 * ks + ((2 * quad + 1) ^ 4),
                                   16 * ks + 2 * quad + 8, 16 * ks + ((2 * quad + 1) ^ 4) + 8};
            uint4 v[4];
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                v[r] = load_shared(swizzled_chunk(box, tokens[r], quad_row));
                if constexpr (kMasked) {
                    if (tokens[r] >= valid) v[r] = make_uint4(0u, 0u, 0u, 0u);
                }
            }
            constexpr int kBatch = 2;                                 // tiles a batch: fewer fragments live
            #pragma unroll
            for (int batch = 0; batch < kTilesV / kBatch; ++batch) {
                uint32_t a[kBatch][4];
                #pragma unroll
                for (int i = 0; i < kBatch; ++i) {                    // column bytes 2t, 2t + 1 of each token
                    const int t = kBatch * batch + i;
                    const uint32_t selector = t % 2 ? 0x7362u : 0x5140u;
                    const uint32_t x = byte_perm(word_of(v[0], t / 2), word_of(v[1], t / 2), selector);
                    const uint32_t y = byte_perm(word_of(v[2], t / 2), word_of(v[3], t / 2), selector);
                    const Fp16x2Pair cx = e4m3x4_to_fp16x2(x), cy = e4m3x4_to_fp16x2(y);
                    a[i][0] = cx.lo;
                    a[i][1] = cx.hi;
                    a[i][2] = cy.lo;
                    a[i][3] = cy.hi;
                }
                #pragma unroll
                for (int i = 0; i < kBatch; ++i) fence_accumulators(o[kBatch * batch + i]);
                cute::warpgroup_arrive();
                #pragma unroll
                for (int i = 0; i < kBatch; ++i) mma(a[i], advance_desc(p_desc, 32 * ks), o[kBatch * batch + i], true);
                cute::warpgroup_commit_batch();
                cute::warpgroup_wait<1>();
            }
        }
        cute::warpgroup_wait<0>();
        #pragma unroll
        for (int t = 0; t < kTilesV; ++t) fence_accumulators(o[t]);  // O is read only after the wait
    }

    // The rows' softmax sums: the warp's 16 tokens by shuffles, then the four warps'.
    __device__ __forceinline__ void reduce_sums(float (&sums)[kRowsPerThread]) {
        #pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            float l = row_sum[i];
            #pragma unroll
            for (int mask = 4; mask < 32; mask *= 2) l += __shfl_xor_sync(0xffffffffu, l, mask);
            if (quad_row == 0) st.row_sum[group][warp][row_of(i)] = l;
        }
        sync_group(NarrowBarrier::kSums);
        #pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            const int row = row_of(i);
            sums[i] = 0.0f;
            #pragma unroll
            for (int w = 0; w < kNarrowWarps; ++w) sums[i] += st.row_sum[group][w][row];
        }
    }

    __device__ __forceinline__ bool merge_groups(float (&sums)[kRowsPerThread], bool& bad) {
        return Base::merge_groups(o, row_max, sums, bad, warp == 0 && quad_row == 0,
                                  [](int e) { return 2 * (e / 4) + e % 2; }, [this](int i) { return row_of(i); });
    }

    // O / sum (times k_scale) and lse of the request's rows.
    __device__ __forceinline__ void store(const NarrowOutput& out, const float (&sums)[kRowsPerThread]) const {
        #pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            const int q_row = row_of(i);
            if (q_row >= out.rows) continue;
            const float factor = row_factor(out, sums[i]);
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                float v[8];
                #pragma unroll
                for (int c = 0; c < 8; ++c) {                         // column 8 half + c = 2t + h
                    const int t = 4 * half + c / 2, h = c % 2;
                    v[c] = o[t][4 * (i / 2) + 2 * h + i % 2] * factor;
                }
                write_columns(out, q_row, first_column() + 8 * half, v);
            }
            if (warp == 0 && quad_row == 0) write_lse(out, q_row, sums[i], row_max[i]);
        }
    }

    __device__ __forceinline__ static void fence_accumulators(float (&d)[16]) {
        #pragma unroll
        for (int i = 0; i < 16; ++i) cute::warpgroup_fence_operand(d[i]);
    }

    // D (+)= A B, m64n32k16; `accumulate` false: D = A B.
    __device__ __forceinline__ static void mma(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[16], bool accumulate) {
        Mma::fma(a[0], a[1], a[2], a[3], desc_b, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10],
                 d[11], d[12], d[13], d[14], d[15],
                 accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
    }
};

}  // namespace flashmla
