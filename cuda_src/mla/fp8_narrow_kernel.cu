// Dense decoding over the FP8 cache with a bf16 q for at most 16 query rows per KV head
// (h_q * s_q / h_kv <= 16, the most memory-bound shapes): the "narrow" kernel.
//
// The split-KV kernel's FP8 form pads these rows to the 64 of a WGMMA and needs each page in fp16
// in shared memory, expanded by a warpgroup whose chain of conversions, stores and barriers bounds
// it (docs/perf-notes.md section 16). Here the MMA is mma.sync (m16n8k16, fp16 in, fp32 out),
// whose B operand comes from registers: the consumer warps convert the staged e4m3 bytes straight
// into fragments, and shared memory holds only bytes, a ring of kFp8NarrowStages pages.
//
// Grid, metadata, splits and combine kernel are the split-KV kernel's: (1, h_kv, num_sm_parts),
// one CTA per SM, 160 threads.
//   warp 4 (loading): for each page of 64 tokens, its block ids and the TMA boxes of its bytes
//     (fp8_staged.cuh's five boxes, packed: 40 KB) into the next stage once it is free;
//   warps 0-3 (consumers), per page, for the 16 rows (one m16 tile):
//     S = Q K^T: warp w for tokens 16w..16w+15 (two n8 tiles), K converted from the staged bytes;
//     the page's row max over the four warps (shared memory and a named barrier), P = exp2(S -
//       max) in fp16 into shared memory, a second barrier;
//     O += P V: warp w for O's columns 128w..128w+127, P by ldmatrix, V converted from the bytes;
//     one arrival per warp frees the stage.
// 17-32 rows stay with the split-KV kernel: two m16 tiles per warp ran at its speed (the
// mma.sync issue doubles), two groups of four warps slower (each converts the same bytes);
// docs/perf-notes.md section 21.
// Q (bf16, TMA boxes of 64 rows) becomes fp16 in place once per request, as in the split-KV kernel.
//
// Fragment layouts. The reduction dimensions are permuted so that each thread's operands are
// contiguous bytes. QK^T: quad lane c takes dims 16c..16c+15 of each 64, four per k-step (one
// 16-byte load per token and 64 dims, two for Q's fp16). P V: n8 tile j = 4g + s of warp w holds
// O's columns 128w + 32g + 4n + s (n = lane / 4), so a thread reads one 32-bit word per token for
// four tiles and owns 8 contiguous output columns. Column n of QK^T's n8 tile t is token
// 16w + 8t + n / 2 + 4 (n % 2): the rows a quarter warp loads are 4 apart, on other banks under
// the 128-byte swizzle.
#include <cuda/std/cstdint>

#include "common/error.cuh"
#include "common/numeric.cuh"
#include "common/pdl.cuh"
#include "common/sync.cuh"
#include "common/tma.cuh"
#include "mla/config.cuh"
#include "mla/fp8_staged.cuh"
#include "mla/output_layout.cuh"
#include "mla/params.cuh"
#include "mla/splitkv_schedule.cuh"

namespace flashmla {

constexpr int kNarrowWarps = kFp8NarrowThreads / 32 - 1;     // consumers; the last warp loads
static_assert(kNarrowWarps * 16 == kBlockN && kNarrowWarps * 128 == kHeadDimV, "a warp's tokens and columns");
static_assert(kFp8NarrowRows == 16, "one m16 tile of query rows");

struct alignas(1024) NarrowStorage {
    alignas(1024) uint8_t stage[kFp8NarrowStages][kStagedPageBytes];   // staged pages, boxes packed
    alignas(1024) uint16_t q[kTilesK * 64 * kTileCols];                // nine swizzled 64 x 64 tiles (bf16, then fp16)
    alignas(1024) uint16_t p[2][kFp8NarrowRows * kBlockN];             // P (fp16) of even / odd pages, swizzled rows
    float page_max[2][kNarrowWarps][kFp8NarrowRows];                   // each warp's row max of the page (log2)
    float row_sum[kNarrowWarps][kFp8NarrowRows];                       // each warp's share of the softmax sums
    int bad_page[kFp8NarrowStages];                                    // the stage's page met a bad block id
    uint64_t full[kFp8NarrowStages];                                   // the stage's bytes have landed
    uint64_t empty[kFp8NarrowStages];                                  // every consumer warp is done with it
    uint64_t bar_q;
};
#ifndef FLASHMLA_FP8_NARROW_SMEM_BYTES
#error "compile through flashmla_cupy (it defines the host-side shared-memory size)"
#endif
static_assert(sizeof(NarrowStorage) == FLASHMLA_FP8_NARROW_SMEM_BYTES, "host and device shared-memory sizes differ");

// Named barriers of the four consumer warps (0 is __syncthreads).
enum class NarrowBarrier : int { kPageMax = 1, kPReady = 2, kQReady = 3, kSums = 4 };

__device__ __forceinline__ void consumers_sync(NarrowBarrier id) {
    named_barrier_sync(int(id), 32 * kNarrowWarps);
}

// D += A B, m16n8k16, fp16 operands, fp32 accumulators (PTX's fragment layouts).
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ uint32_t load_shared_u32(uint32_t src) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(src) : "memory");
    return v;
}

__device__ __forceinline__ void store_shared_u16(uint32_t dst, uint16_t v) {
    asm volatile("st.shared.u16 [%0], %1;" :: "r"(dst), "h"(v) : "memory");
}

__device__ __forceinline__ uint16_t to_fp16(float x) {
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t stage_address(NarrowStorage& st, int stage) {
    return smem_u32(st.stage[stage]);
}

// The loading warp: every page of the part's requests, in order, into the ring. Each lane loads
// the pieces lane and lane + 32 of a page (a piece: min(page_block_size, 64) rows of one cache
// block, as in the split-KV kernel); a piece past the request's length reads block num_blocks,
// which TMA fills with zeros without reading. A bad block id loads block 0 and flags the page.
__device__ __forceinline__ void load_pages(const SplitKVParams& p, NarrowStorage& st, const SchedRow& row) {
    const int lane = threadIdx.x % 32;
    const int pieces = kBlockN >> p.piece_shift;
    int n = 0;                                                   // pages issued
    #pragma unroll 1
    for (int req = row.range.x; req <= row.end_req; ++req) {
        const RequestSpan span = dense_request_span(p, 0, req, row.range);
        const int* table = p.block_table + req * p.block_table_stride;
        #pragma unroll 1
        for (int page = span.first_page; page < span.end_page; ++page, ++n) {
            const int stage = n % kFp8NarrowStages;
            if (n >= kFp8NarrowStages) mbarrier_wait(smem_u32(&st.empty[stage]), (n / kFp8NarrowStages - 1) & 1);
            int block[2];
            bool bad = false;
            #pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int token = page * kBlockN + ((lane + 32 * k) << p.piece_shift);
                block[k] = p.num_blocks;
                if (lane + 32 * k < pieces && token < span.seqlen) {
                    const int column = token >> p.page_shift;
                    block[k] = table[column];
                    if (static_cast<unsigned>(block[k]) >= static_cast<unsigned>(p.num_blocks)) {
                        report_error(p.error, FLASHMLA_ERROR_BLOCK_ID, req, column, block[k], p.num_blocks);
                        block[k] = 0;
                        bad = true;
                    }
                }
            }
            const uint32_t full = smem_u32(&st.full[stage]);
            bad = __any_sync(0xffffffffu, bad);
            if (lane == 0) {
                st.bad_page[stage] = bad;
                mbarrier_arrive_expect_tx(full, kStagedPageBytes);
            }
            __syncwarp();
            #pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int piece = lane + 32 * k;
                if (piece >= pieces) continue;
                const int first_row = piece << p.piece_shift;
                const int cache_row = (page * kBlockN + first_row) & (p.page_block_size - 1);
                const uint32_t dst = stage_address(st, stage) + first_row * kFp8StagedRowBytes;
                #pragma unroll
                for (int box = 0; box < kStagedBoxes; ++box) {
                    tma_load_4d(&p.tma_kv, full, dst + box * kStagedBoxBytes, box * kFp8StagedRowBytes, cache_row,
                                blockIdx.y, block[k], L2Hint::kEvictFirst);
                }
            }
        }
    }
}

// The four consumer warps.
struct NarrowConsumer {
    const SplitKVParams& p;
    NarrowStorage& st;
    const int warp, lane, quad, quad_row;          // quad: lane % 4; quad_row: lane / 4
    const float scale_log2;                        // the softmax scale times k_scale, log2 domain
    int n = 0;                                     // pages consumed: stage n % kFp8NarrowStages, buffers n % 2

    // The current request: this warp's 16 rows x 128 columns of O, and per row half h (rows quad_row +
    // 8h of the tile) the running max (log2; alike in the four warps), this thread's share of
    // the sum, and the causal border (tokens at or past it are masked).
    float o[16][4];
    float row_max[2];
    float row_sum[2];
    int border[2];

    __device__ __forceinline__ NarrowConsumer(const SplitKVParams& params, NarrowStorage& storage)
        : p(params), st(storage), warp(threadIdx.x / 32), lane(threadIdx.x % 32), quad(lane % 4), quad_row(lane / 4),
          scale_log2(params.scale_log2 * *params.kv_scale) {}

    __device__ __forceinline__ int row_of(int half) const { return quad_row + 8 * half; }

    // One thread issues all of Q for `req` (nine 64 x 64 tiles; rows past q_rows are TMA's zeros).
    __device__ __forceinline__ void load_q(int req) const {
        const uint32_t bar = smem_u32(&st.bar_q);
        mbarrier_arrive_expect_tx(bar, kTilesK * kFp16TileBytes);
        #pragma unroll
        for (int t = 0; t < kTilesK; ++t) {
            tma_load_4d(&p.tma_q, bar, smem_u32(st.q) + t * kFp16TileBytes, t * kTileCols, 0, blockIdx.y, req,
                        L2Hint::kEvictFirst);
        }
    }

    // The first 16 rows of every tile of Q, bf16 -> fp16 in place.
    __device__ __forceinline__ void q_to_fp16() const {
        constexpr int kChunksPerTile = kFp8NarrowRows * kSwizzleRowBytes / 16;
        for (int i = threadIdx.x; i < kTilesK * kChunksPerTile; i += 32 * kNarrowWarps) {
            const uint32_t addr = smem_u32(st.q) + (i / kChunksPerTile) * kFp16TileBytes + (i % kChunksPerTile) * 16;
            const uint4 v = load_shared(addr);
            store_shared(addr, make_uint4(bf16x2_to_fp16x2(v.x), bf16x2_to_fp16x2(v.y), bf16x2_to_fp16x2(v.z),
                                          bf16x2_to_fp16x2(v.w)));
        }
        consumers_sync(NarrowBarrier::kQReady);
    }

    // S = Q K^T for this warp's 16 tokens of the staged page at `page`.
    __device__ __forceinline__ void scores(uint32_t page, float (&s)[2][4]) const {
        const int token = 16 * warp + (quad_row >> 1) + 4 * (quad_row & 1);   // of n8 tile 0 (+8 for tile 1)
        #pragma unroll
        for (int t = 0; t < 2; ++t) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) s[t][i] = 0.0f;
        }
        #pragma unroll
        for (int blk = 0; blk < kTilesK; ++blk) {                   // 64 dims: box blk / 2, bytes 64 (blk % 2)..
            const uint32_t box = page + (blk / 2) * kStagedBoxBytes;
            uint4 k[2];
            #pragma unroll
            for (int t = 0; t < 2; ++t) k[t] = load_shared(swizzled_chunk(box, token + 8 * t, (blk % 2) * 4 + quad));
            const uint32_t q_tile = smem_u32(st.q) + blk * kFp16TileBytes;
            uint4 q[2][2];                                           // [row half][dims 16c..+7, +8..+15]
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                q[h][0] = load_shared(swizzled_chunk(q_tile, row_of(h), 2 * quad));
                q[h][1] = load_shared(swizzled_chunk(q_tile, row_of(h), 2 * quad + 1));
            }
            #pragma unroll
            for (int kk = 0; kk < 4; ++kk) {                         // dims 16c + 4kk .. + 3
                const int w = 2 * (kk % 2);
                const uint32_t a[4] = {word_of(q[0][kk / 2], w), word_of(q[1][kk / 2], w),
                                       word_of(q[0][kk / 2], w + 1), word_of(q[1][kk / 2], w + 1)};
                #pragma unroll
                for (int t = 0; t < 2; ++t) {
                    const uint32_t bytes = word_of(k[t], kk);
                    mma_16816(s[t], a, e4m3x2_to_fp16x2(bytes & 0xffffu), e4m3x2_to_fp16x2(bytes >> 16));
                }
            }
        }
    }

    // The online softmax of one page (`first_token`: its first token of the request): scales and
    // masks S, agrees on the row max with the other warps, rescales O and the sums, and
    // stores P. The running max moves only when the page's passes it by more than 2^8 (P <= 2^8
    // in fp16), so after the first pages the factors are exactly 1 and O is left alone.
    template <bool kMasked>
    __device__ __forceinline__ void softmax(float (&s)[2][4], int first_token) {
        const int parity = n & 1;
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
            if (quad == 0) st.page_max[parity][warp][row_of(h)] = mx;
        }
        consumers_sync(NarrowBarrier::kPageMax);
        bool rescale = false;
        float factor[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = st.page_max[parity][0][row_of(h)];
            #pragma unroll
            for (int w = 1; w < kNarrowWarps; ++w) mx = fmaxf(mx, st.page_max[parity][w][row_of(h)]);
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
        const uint32_t p_buf = smem_u32(st.p[parity]);
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
        consumers_sync(NarrowBarrier::kPReady);
    }

    // O += P V for this warp's 128 columns (`valid`: the page's tokens before the request's end;
    // kMasked: V of the others is taken as 0, whatever their bytes hold).
    template <bool kMasked>
    __device__ __forceinline__ void values(uint32_t page, int valid) {
        const uint32_t p_buf = smem_u32(st.p[n & 1]);
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
                const uint32_t lo = byte_perm(w[0], w[1], 0x5140), hi = byte_perm(w[0], w[1], 0x7362);
                const uint32_t lo8 = byte_perm(w[2], w[3], 0x5140), hi8 = byte_perm(w[2], w[3], 0x7362);
                const uint32_t b0[4] = {lo & 0xffffu, lo >> 16, hi & 0xffffu, hi >> 16};
                const uint32_t b1[4] = {lo8 & 0xffffu, lo8 >> 16, hi8 & 0xffffu, hi8 >> 16};
                #pragma unroll
                for (int sub = 0; sub < 4; ++sub) {
                    mma_16816(o[4 * g + sub], a, e4m3x2_to_fp16x2(b0[sub]), e4m3x2_to_fp16x2(b1[sub]));
                }
            }
        }
    }

    template <bool kMasked>
    __device__ __forceinline__ void page_step(int first_token, int valid) {
        const int stage = n % kFp8NarrowStages;
        const uint32_t page = stage_address(st, stage);
        float s[2][4];
        scores(page, s);
        softmax<kMasked>(s, first_token);
        values<kMasked>(page, valid);
        __syncwarp();
        if (lane == 0) mbarrier_arrive(smem_u32(&st.empty[stage]));
        ++n;
    }

    // The part's requests [range.x, end_req], from the first Q load to the last output.
    __device__ __forceinline__ void run(const SchedRow& row) {
        const int begin_req = row.range.x;
        if (threadIdx.x == 0) load_q(begin_req);
        #pragma unroll 1
        for (int req = begin_req; req <= row.end_req; ++req) {
            const RequestSpan span = dense_request_span(p, 0, req, row.range);
            if (span.bad && threadIdx.x == 0) {
                report_error(p.error, FLASHMLA_ERROR_SEQLEN_RANGE, req, p.page_block_size, p.seqlens[req],
                             p.max_blocks_per_seq);
            }
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
            mbarrier_wait(smem_u32(&st.bar_q), (req - begin_req) & 1);
            q_to_fp16();

            // Pages from `masked_page` on hold a masked token of some row, or the request's end.
            const int masked_page = (span.seqlen - (p.causal ? p.s_q - 1 : 0)) / kBlockN;
            bool bad = false;
            #pragma unroll 1
            for (int page = span.first_page; page < span.end_page; ++page) {
                const int stage = n % kFp8NarrowStages;
                mbarrier_wait(smem_u32(&st.full[stage]), (n / kFp8NarrowStages) & 1);
                bad |= st.bad_page[stage] != 0;
                const int first_token = page * kBlockN;
                if (page >= masked_page) {
                    page_step<true>(first_token, span.seqlen - first_token);
                } else {
                    page_step<false>(first_token, kBlockN);
                }
            }

            float sums[2];
            reduce_sums(sums);
            if (req < row.end_req) {
                if (threadIdx.x == 0) {                           // every warp is past Q (reduce_sums)
                    fence_smem_for_async_proxy();
                    load_q(req + 1);
                }
            } else {
                pdl_allow_dependents();                           // the combine kernel may start
            }
            store(req, row, span, bad, sums);
        }
    }

    // The rows' softmax sums: the quads', then the four warps' through shared memory.
    __device__ __forceinline__ void reduce_sums(float (&sums)[2]) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = row_sum[h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            if (quad == 0) st.row_sum[warp][row_of(h)] = l;
        }
        consumers_sync(NarrowBarrier::kSums);
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row_of(h);
            sums[h] = st.row_sum[0][row] + st.row_sum[1][row] + st.row_sum[2][row] + st.row_sum[3][row];
        }
    }

    // O / sum (times k_scale) and lse of the request: final rows in bf16 and lse in natural log,
    // or a split's fp32 rows and log2 lse for the combine kernel; NaN for a bad request.
    __device__ __forceinline__ void store(int req, const SchedRow& row, const RequestSpan& span, bool bad,
                                          const float (&sums)[2]) const {
        const long long split = (long long)p.num_splits[req] + (req == row.range.x ? row.begin_split : 0);
        const int split_idx = span.whole ? -1 : static_cast<int>(split);
        int num_rows = p.q_rows;
        if (!span.whole && (split < 0 || split >= p.total_splits)) {
            if (threadIdx.x == 0) report_error(p.error, FLASHMLA_ERROR_SCHEDULE, req, 0, static_cast<int>(split), p.total_splits);
            num_rows = 0;                                         // nowhere valid to write
        }
        bad |= span.bad;
        const float v_scale = *p.kv_scale;
        const int kv_head = blockIdx.y;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int q_row = row_of(h);
            if (q_row >= num_rows) continue;
            const float sum = sums[h];
            const float factor = bad ? kNaN : no_visible_token(sum) ? 1.0f : v_scale / sum;   // O = 0 if none
            #pragma unroll
            for (int g = 0; g < 4; ++g) {
                const int col = 128 * warp + 32 * g + 8 * quad;
                float v[8];
                #pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = o[4 * g + e % 4][2 * h + e / 4] * factor;
                if (split_idx < 0) {
                    const uint4 packed = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]),
                                                    pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
                    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.o) +
                        (((int64_t)req * p.q_rows + q_row) * p.h_kv + kv_head) * kHeadDimV + col) = packed;
                } else {
                    float4* dst = reinterpret_cast<float4*>(p.o_accum +
                        (((int64_t)split_idx * p.h_kv + kv_head) * p.q_rows + q_row) * kHeadDimV + col);
                    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
                    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
                }
            }
            if (warp == 0 && quad == 0) {
                const float lse = row_lse(sum, row_max[h], bad, split_idx >= 0);
                if (split_idx < 0) {
                    const int head = kv_head * p.heads_per_kv + q_row % p.heads_per_kv;
                    p.lse[lse_index(req, head, q_row / p.heads_per_kv, p.h_q, p.s_q, 1)] = lse;
                } else {
                    p.lse_accum[((int64_t)split_idx * p.h_kv + kv_head) * p.q_rows + q_row] = lse;
                }
            }
        }
    }

    __device__ __forceinline__ static uint32_t pack_bf16x2(float lo, float hi) {
        uint32_t d;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
        return d;
    }
};

__global__ void __launch_bounds__(kFp8NarrowThreads, 1)
fp8_narrow_mla_kernel(const __grid_constant__ SplitKVParams p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    auto& st = *reinterpret_cast<NarrowStorage*>(smem);
    if (threadIdx.x == 0) {
        tma_prefetch_descriptor(&p.tma_q);
        tma_prefetch_descriptor(&p.tma_kv);
        mbarrier_init(smem_u32(&st.bar_q), 1);
        for (int s = 0; s < kFp8NarrowStages; ++s) {
            mbarrier_init(smem_u32(&st.full[s]), 1);                              // the loading warp's byte count
            mbarrier_init(smem_u32(&st.empty[s]), kNarrowWarps);                  // one arrival per consumer warp
        }
        mbarrier_init_fence();
    }
    __syncthreads();

    pdl_wait_for_producers();                                        // metadata and inputs from here on
    const SchedRow row = sched_row(p, p.sched_meta + blockIdx.z * kSchedMetaInts);
    if (!part_is_runnable(p, row, -1)) return;
    if (threadIdx.x / 32 == kNarrowWarps) {
        load_pages(p, st, row);
        return;
    }
    NarrowConsumer consumer(p, st);
    consumer.run(row);
}

}  // namespace flashmla
