// Minimal FlashAttention forward in float32: the toolkit's teaching kernel.
//
//   out[i] = sum_j softmax_j(scale * q_i . k_j) v_j,    lse[i] = log sum_j exp(scale * q_i . k_j)
//
// (under the causal mask only keys j <= i take part), computed without ever storing the N x N
// score matrix: a CTA owns a tile of kBlockM = 32 query rows and walks the keys in tiles of
// kBlockN = 32, keeping for each of its rows the running max m, the running sum l of exp(s - m)
// and the unnormalized output in registers ("online softmax"). The classic tutorial version this
// follows loops over key tiles outside and query tiles inside, so it must park m and l in global
// memory between key tiles; here the loops are the other way round (queries per CTA, keys inside),
// so m and l never leave the chip. Loads past the sequence end are masked, so any N >= 1 works.
//
// Grid: (ceil(N / 32), heads, batch); 128 threads = 4 warps; warp w owns query rows 8w .. 8w + 7
// of the tile. Key tiles are exactly one warp wide: lane j scores key j of the tile against the
// warp's 8 rows, so a row's max and sum are warp reductions, and lane j owns output columns
// j, j + 32, j + 64, j + 96 (those below head_dim).
//
// Speed: scalar FFMA on CUDA cores, fed from shared memory, loads not overlapped with math; no
// tensor cores, no asynchronous copies, no reuse of a K/V tile across query tiles. It is written
// to be read and to be right for every shape; `flashmla-cupy profile attention` says how it
// compares with the manual (matmul, softmax, matmul) version.
#include "attention/params.cuh"
#include "common/numeric.cuh"

namespace flashmla {

constexpr int kBlockM = 32;                       // query rows per CTA (the tutorial's Br)
constexpr int kBlockN = 32;                       // key rows per tile (the tutorial's Bc)
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = kBlockM / kWarps;    // 8
static_assert(kBlockN == 32, "lane j of a warp scores key j of a tile");
static_assert(kBlockM == kBlockN, "the causal loop bound counts key tiles up to the diagonal tile");

constexpr unsigned kFullWarp = 0xffffffffu;

__device__ __forceinline__ float warp_max(float x) {
    #pragma unroll
    for (int offset = 16; offset >= 1; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, offset));
    return x;
}

// A butterfly: every lane ends with the same sum (each pairwise step adds the same two numbers).
__device__ __forceinline__ float warp_sum(float x) {
    #pragma unroll
    for (int offset = 16; offset >= 1; offset /= 2) x += __shfl_xor_sync(kFullWarp, x, offset);
    return x;
}

// Where element (row, col) of the K tile lives. Scoring reads K by column: at step x of the dot
// product lane j reads K[j][x], so with rows of a multiple of 32 floats all 32 lanes would hit
// the same bank. XOR-ing the column with the row (< 32, so the column stays inside its group of
// 32) spreads such a column over all 32 banks, and a row written left to right still touches 32
// different banks. Unlike padding each row by one float, it costs no shared memory: the three
// tiles of the 128-wide variant fill exactly 48 KiB, the most a CTA gets without opting in.
template <int kHeadDimTile>
__device__ __forceinline__ int k_tile_index(int row, int col) {
    return row * kHeadDimTile + (col ^ row);
}

// Copies rows [first_row, first_row + 32) of one head's [seqlen][head_dim] matrix into a
// 32 x kHeadDimTile shared tile, writing zeros for rows past the sequence end and columns past
// head_dim. The zeros matter: they make the padded columns add nothing to dot products and
// outputs, and keep shared memory's stale or uninitialized bits (possibly NaN) out of the
// products with the zero probabilities of masked keys. The 32 rows are contiguous in global
// memory, so consecutive threads read consecutive floats.
template <int kHeadDimTile, bool kIsKTile>
__device__ __forceinline__ void load_tile(float* tile, const float* head_matrix, int first_row,
                                          int seqlen, int head_dim) {
    #pragma unroll 4
    for (int i = threadIdx.x; i < kBlockM * kHeadDimTile; i += kThreads) {
        const int row = i / kHeadDimTile, col = i % kHeadDimTile;
        const bool inside = first_row + row < seqlen && col < head_dim;
        const float x = inside ? head_matrix[(int64_t)(first_row + row) * head_dim + col] : 0.0f;
        tile[kIsKTile ? k_tile_index<kHeadDimTile>(row, col) : row * kHeadDimTile + col] = x;
    }
}

// kHeadDimTile: head_dim rounded up to 32, 64 or 128 (the width of the shared tiles).
template <int kHeadDimTile>
__global__ void __launch_bounds__(kThreads)
flash_attn_minimal_kernel(const FlashAttnMinimalParams p) {
    static_assert(kHeadDimTile % 32 == 0 && kHeadDimTile <= 128, "one to four output columns per lane");
    constexpr int kColsPerLane = kHeadDimTile / 32;

    extern __shared__ float smem[];
    float* q_tile = smem;                                   // [kBlockM][kHeadDimTile]
    float* k_tile = q_tile + kBlockM * kHeadDimTile;        // [kBlockN][kHeadDimTile], see k_tile_index
    float* v_tile = k_tile + kBlockN * kHeadDimTile;        // [kBlockN][kHeadDimTile]

    const int q_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int first_q_row = q_block * kBlockM;
    const int warp_row = warp * kRowsPerWarp;               // first row of this warp in the tile

    // Per-(batch, head) base offsets, as in the tutorial. q, k, v and out are row-major
    // [batch][heads][seqlen][head_dim]: before head `head` of batch entry `batch` come
    // batch * heads + head whole [seqlen][head_dim] matrices (the tutorial's
    // qkv_offset = bx * nh * N * d + by * N * d). lse is [batch][heads][seqlen]: the same number
    // of whole vectors of seqlen floats (the tutorial's lm_offset, which it used for l and m).
    // 64-bit, since batch * heads * seqlen * head_dim may pass 2^31.
    const int64_t head_index = (int64_t)batch * p.heads + head;
    const int64_t qkv_offset = head_index * p.seqlen * p.head_dim;
    const int64_t lse_offset = head_index * p.seqlen;

    load_tile<kHeadDimTile, false>(q_tile, p.q + qkv_offset, first_q_row, p.seqlen, p.head_dim);

    // State of the warp's 8 rows. Every lane holds the same m and l (they come out of warp
    // reductions); acc holds the lane's own output columns.
    float row_max[kRowsPerWarp], row_sum[kRowsPerWarp], acc[kRowsPerWarp][kColsPerLane];
    #pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
        row_max[r] = -kInf;
        row_sum[r] = 0.0f;
        #pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) acc[r][c] = 0.0f;
    }

    // Under the causal mask no row of this tile sees a key past its last row, so key tiles stop
    // at the diagonal tile (kBlockM == kBlockN).
    const int num_k_blocks_all = (p.seqlen + kBlockN - 1) / kBlockN;
    const int num_k_blocks = p.causal ? min(q_block + 1, num_k_blocks_all) : num_k_blocks_all;

    for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
        const int first_k_row = k_block * kBlockN;
        __syncthreads();    // every warp is done with the previous K and V tiles
        load_tile<kHeadDimTile, true>(k_tile, p.k + qkv_offset, first_k_row, p.seqlen, p.head_dim);
        load_tile<kHeadDimTile, false>(v_tile, p.v + qkv_offset, first_k_row, p.seqlen, p.head_dim);
        __syncthreads();    // the tiles (and, the first time, Q) are complete

        // Scores of key `lane` against the warp's rows. Q reads are broadcasts (one address per
        // warp; the compiler merges four columns into one 16-byte load), K reads hit 32 banks
        // (k_tile_index). Unrolled by 8, not fully: a full unroll lets the compiler hoist loads
        // far ahead and take ~250 registers in the 128-wide variant (96 this way).
        float score[kRowsPerWarp];
        #pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) score[r] = 0.0f;
        #pragma unroll 8
        for (int x = 0; x < kHeadDimTile; ++x) {
            const float key_x = k_tile[k_tile_index<kHeadDimTile>(lane, x)];
            #pragma unroll
            for (int r = 0; r < kRowsPerWarp; ++r) score[r] += q_tile[(warp_row + r) * kHeadDimTile + x] * key_x;
        }

        // Online softmax. With m' = max(m, max_j s_j): l' = l * exp(m - m') + sum_j exp(s_j - m')
        // and acc' = acc * exp(m - m') + sum_j exp(s_j - m') v_j. No (-inf) - (-inf) = NaN can
        // arise: every visited tile holds, for every row, a visible key (its first key is < seqlen
        // and, under the causal mask, <= the row, since k_block <= q_block), so m' is finite, and
        // on the first tile exp(m - m') = exp(-inf) = 0 just clears the empty state.
        const int key = first_k_row + lane;
        float prob[kRowsPerWarp];
        #pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
            const int query = first_q_row + warp_row + r;
            const bool visible = key < p.seqlen && !(p.causal && key > query);
            const float s = visible ? score[r] * p.softmax_scale : -kInf;
            const float new_max = fmaxf(row_max[r], warp_max(s));
            const float rescale = expf(row_max[r] - new_max);
            prob[r] = expf(s - new_max);                    // 0 for masked keys
            row_sum[r] = row_sum[r] * rescale + warp_sum(prob[r]);
            row_max[r] = new_max;
            #pragma unroll
            for (int c = 0; c < kColsPerLane; ++c) acc[r][c] *= rescale;
        }

        // acc += P V. Lane j holds column j of P; a shuffle hands P[r][j] to the whole warp, and
        // each lane multiplies it into its own columns of V's row j (consecutive lanes read
        // consecutive floats: no bank conflicts).
        #pragma unroll
        for (int j = 0; j < kBlockN; ++j) {
            float value[kColsPerLane];
            #pragma unroll
            for (int c = 0; c < kColsPerLane; ++c) value[c] = v_tile[j * kHeadDimTile + c * 32 + lane];
            #pragma unroll
            for (int r = 0; r < kRowsPerWarp; ++r) {
                const float p_rj = __shfl_sync(kFullWarp, prob[r], j);
                #pragma unroll
                for (int c = 0; c < kColsPerLane; ++c) acc[r][c] += p_rj * value[c];
            }
        }
    }

    // Normalize and store the rows that exist. row_sum >= 1 (the max term contributes exp(0)).
    #pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
        const int query = first_q_row + warp_row + r;
        if (query >= p.seqlen) break;                       // rows grow with r
        const float inv_sum = 1.0f / row_sum[r];
        float* out_row = p.out + qkv_offset + (int64_t)query * p.head_dim;
        #pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) {
            const int col = c * 32 + lane;
            if (col < p.head_dim) out_row[col] = acc[r][c] * inv_sum;
        }
        if (lane == 0) p.lse[lse_offset + query] = row_max[r] + logf(row_sum[r]);
    }
}

}  // namespace flashmla
