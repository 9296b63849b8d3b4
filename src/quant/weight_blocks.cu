// One CTA of 256 threads per 128 x 128 block (a last block along a dimension of 64 mod 128 holds 64
// of it), reading global memory once: each thread loads 8 rows x 8 bf16 (16-byte loads, kept in
// registers), the block's amax is reduced over the CTA, then each thread writes its values as
// 8-byte e4m3 stores. A warp covers two 256-byte block rows per load, so every access is
// coalesced. The numerics are the host's (numerics::block_scale; the amax, the division and the
// E4M3 conversion through device instructions that give numerics::amax_with's, IEEE division's and
// numerics::to_e4m3's bits), so the reference's bits.
//
// The transposed kernel loads and scales the same way, then goes through a 16 KiB shared tile: the
// e4m3 bytes are stored there as they lie in w, and read back as 8 x 8 byte squares that each
// thread transposes in registers, so its stores are 8-byte runs of an output row and a half-warp
// writes 128 contiguous bytes of one. The tile's 8-byte chunks are XOR-swizzled so that both the
// row-wise writes and the column-wise square reads are free of bank conflicts.
#include "quant/weight_blocks.hpp"

#include "quant/e4m3_vectors.cuh"

#include "numerics/block_scaling.hpp"
#include "runtime/cuda_check.hpp"

namespace poise::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlock = static_cast<int>(numerics::kScaleBlock);
constexpr int kVector = 8;                                  // bf16 per 16-byte load
constexpr int kThreadsPerRow = kBlock / kVector;            // 16 threads span a block row
constexpr int kRowsPerStep = kThreads / kThreadsPerRow;     // 16 block rows per CTA-wide load
constexpr int kSteps = kBlock / kRowsPerStep;               // 8 loads (64 values) per thread
constexpr int kSquare = 8;                                  // the transposed kernel's byte squares
constexpr int kSquares = kBlock / kSquare;                  // 16 along each side of a block
static_assert(kSquares * kSquares == kThreads, "one 8 x 8 square of the transposed tile per thread");
static_assert(kSquare == kVector, "a tile chunk (one thread's 8 e4m3 of a row) is one square row");

// The block CTA blockIdx.x quantizes: grid index (matrix * row_blocks + row block) * col_blocks +
// col block, split in 32 bits (the grid's limit).
struct Block {
  uint32_t m, rb, cb;             // matrix, row block, column block
  int64_t r0, c0, height, width;  // first row and column; 128, or 64 for a last block
  __device__ Block(int64_t rows, int64_t cols, uint32_t row_blocks, uint32_t col_blocks)
      : m(blockIdx.x / col_blocks / row_blocks),
        rb(blockIdx.x / col_blocks % row_blocks),
        cb(blockIdx.x % col_blocks),
        r0(int64_t(rb) * kBlock),
        c0(int64_t(cb) * kBlock),
        height(min(numerics::kScaleBlock, rows - r0)),
        width(min(numerics::kScaleBlock, cols - c0)) {}
  // Its scale's place in each layout: [matrices][row_blocks][col_blocks], or transposed.
  __device__ uint32_t scale_index(bool transposed, uint32_t row_blocks, uint32_t col_blocks) const {
    return transposed ? (m * col_blocks + cb) * row_blocks + rb : blockIdx.x;
  }
};

// This thread's part of its block in the vector kernels: columns col..col+7 of the block rows
// row0, row0 + 16, ..., row0 + 112 (one 16-byte load each).
struct Part : Block {
  int col = threadIdx.x % kThreadsPerRow * kVector, row0 = threadIdx.x / kThreadsPerRow;
  int64_t first, step;  // the offset in w of its first value; between its rows
  __device__ Part(int64_t rows, int64_t cols, uint32_t row_blocks, uint32_t col_blocks)
      : Block(rows, cols, row_blocks, col_blocks),
        first((m * rows + r0 + row0) * cols + c0 + col),
        step(kRowsPerStep * cols) {}
  __device__ int row(int s) const { return row0 + s * kRowsPerStep; }
  __device__ bool holds(int s) const { return col < width && row(s) < height; }  // 64-wide/high blocks
  __device__ int64_t at(int s) const { return first + s * step; }
};

// The CTA's amax as a float: one max per warp, then across the warps through shared memory.
__device__ float block_amax(uint32_t amax_bits) {
  __shared__ uint32_t warp_amax[kWarps];
  amax_bits = __reduce_max_sync(~0u, amax_bits);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax_bits;
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) amax_bits = max(amax_bits, warp_amax[w]);
  return __uint_as_float(amax_bits << 16);  // bf16 -> fp32 is exact: the top half of the bits
}

// The vector kernels' start: the CTA loads its block, each thread its part into v (zeros where a
// 64-wide or -high block holds nothing), and returns the block's scale. All loads are issued
// before the reduction waits on any of them.
__device__ float load_block(const __nv_bfloat16* w, const Part& p, uint4 (&v)[kSteps]) {
  uint32_t amax_bits = 0;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    v[s] = p.holds(s) ? __ldg(reinterpret_cast<const uint4*>(w + p.at(s))) : make_uint4(0, 0, 0, 0);
    amax_bits = max(amax_bits, amax_bits_of(v[s]));
  }
  return numerics::block_scale(block_amax(amax_bits));
}

// w, values: 16- and 8-byte aligned (cols is a multiple of 64, so every row of a block is too).
__global__ void __launch_bounds__(kThreads) weight_blocks_kernel(const __nv_bfloat16* w, int64_t rows, int64_t cols,
                                                                  uint32_t row_blocks, uint32_t col_blocks,
                                                                  uint8_t* values, float* scales,
                                                                  const int32_t* rows_M) {
  const Part p(rows, cols, row_blocks, col_blocks);
  if (rows_M != nullptr && rows_M[p.m] == 0) return;
  uint4 v[kSteps];
  const float scale = load_block(w, p, v);
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    if (p.holds(s)) *reinterpret_cast<uint2*>(values + p.at(s)) = quantize_bf16x8(v[s], scale);
  }
}

// The 4 x 4 bytes of x[0..3] (word i: row i, byte j: column j) transposed in place.
__device__ __forceinline__ void transpose_bytes_4x4(uint32_t& x0, uint32_t& x1, uint32_t& x2, uint32_t& x3) {
  const uint32_t lo01 = __byte_perm(x0, x1, 0x5140), lo23 = __byte_perm(x2, x3, 0x5140);  // columns 0, 1
  const uint32_t hi01 = __byte_perm(x0, x1, 0x7362), hi23 = __byte_perm(x2, x3, 0x7362);  // columns 2, 3
  x0 = __byte_perm(lo01, lo23, 0x5410), x1 = __byte_perm(lo01, lo23, 0x7632);
  x2 = __byte_perm(hi01, hi23, 0x5410), x3 = __byte_perm(hi01, hi23, 0x7632);
}

// The 8 x 8 bytes of s[0..7] (s[i]: row i, in order) transposed in place: four 4 x 4 quadrants
// transposed, the off-diagonal two swapped.
__device__ __forceinline__ void transpose_bytes_8x8(uint2 (&s)[kSquare]) {
  transpose_bytes_4x4(s[0].x, s[1].x, s[2].x, s[3].x);
  transpose_bytes_4x4(s[4].y, s[5].y, s[6].y, s[7].y);
  transpose_bytes_4x4(s[0].y, s[1].y, s[2].y, s[3].y);
  transpose_bytes_4x4(s[4].x, s[5].x, s[6].x, s[7].x);
  for (int i = 0; i < 4; ++i) {
    const uint32_t upper_right = s[i].y;
    s[i].y = s[4 + i].x, s[4 + i].x = upper_right;
  }
}

// The shared tile's chunk for the 8 bytes of block row r at columns 8k..8k+7. A half-warp of 8-byte
// accesses covers the 32 banks once with 16 distinct chunks of a row: the writes' half-warp holds
// one row (all k, a permutation for any r); the reads' holds chunk k of rows 8a + i, a = 0..15,
// which the XOR with a = r / 8 spreads over the 16 chunks.
__device__ __forceinline__ int swizzled(int r, int k) { return k ^ (r / kSquare); }

// weight_blocks_kernel's values written transposed: values [matrices][cols][rows], scales
// [matrices][col_blocks][row_blocks]. w, values: 16- and 8-byte aligned (rows too is a multiple of
// 64, so every output row of a block is 8-byte aligned).
__global__ void __launch_bounds__(kThreads)
    weight_blocks_transposed_kernel(const __nv_bfloat16* w, int64_t rows, int64_t cols, uint32_t row_blocks,
                                    uint32_t col_blocks, uint8_t* values, float* scales, const int32_t* rows_M) {
  __shared__ uint2 tile[kBlock][kSquares];  // the block's e4m3 as in w, chunks swizzled
  const Part p(rows, cols, row_blocks, col_blocks);
  if (rows_M != nullptr && rows_M[p.m] == 0) return;
  uint4 v[kSteps];
  const float scale = load_block(w, p, v);
  if (threadIdx.x == 0) scales[p.scale_index(true, row_blocks, col_blocks)] = scale;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    if (p.holds(s)) tile[p.row(s)][swizzled(p.row(s), p.col / kVector)] = quantize_bf16x8(v[s], scale);
  }
  __syncthreads();

  // This thread's square: block rows 8a..8a+7, columns 8b..8b+7 (a half-warp: a = 0..15, one b), so
  // output rows c0 + 8b + j at 8a: a half-warp's stores are 128 contiguous bytes of each.
  const int a = threadIdx.x % kSquares, b = threadIdx.x / kSquares;
  if (a * kSquare >= p.height || b * kSquare >= p.width) return;  // outside a 64-high or -wide block
  uint2 square[kSquare];
#pragma unroll
  for (int i = 0; i < kSquare; ++i) square[i] = tile[a * kSquare + i][swizzled(a * kSquare + i, b)];
  transpose_bytes_8x8(square);
  uint8_t* const out = values + (p.m * cols + p.c0 + b * kSquare) * rows + p.r0 + a * kSquare;
#pragma unroll
  for (int j = 0; j < kSquare; ++j) *reinterpret_cast<uint2*>(out + j * rows) = square[j];
}

// Pointers not aligned for the vector loads and stores (a view at an odd offset): one value at a
// time, with the host's functions, in either layout. Correct, not fast.
template <bool kTransposed>
__global__ void __launch_bounds__(kThreads) weight_blocks_unaligned_kernel(const __nv_bfloat16* w, int64_t rows,
                                                                            int64_t cols, uint32_t row_blocks,
                                                                            uint32_t col_blocks, uint8_t* values,
                                                                            float* scales, const int32_t* rows_M) {
  const Block b(rows, cols, row_blocks, col_blocks);
  if (rows_M != nullptr && rows_M[b.m] == 0) return;
  const int64_t first = b.m * rows * cols + b.r0 * cols + b.c0;
  __shared__ float warp_amax[kWarps];
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < b.height * b.width; i += kThreads)
    amax = numerics::amax_with(amax, __bfloat162float(w[first + i / b.width * cols + i % b.width]));
  for (int offset = 16; offset > 0; offset /= 2) amax = numerics::amax_with(amax, __shfl_xor_sync(~0u, amax, offset));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  for (int i = 0; i < kWarps; ++i) amax = numerics::amax_with(amax, warp_amax[i]);
  const float scale = numerics::block_scale(amax);
  if (threadIdx.x == 0) scales[b.scale_index(kTransposed, row_blocks, col_blocks)] = scale;
  for (int64_t i = threadIdx.x; i < b.height * b.width; i += kThreads) {
    const int64_t r = b.r0 + i / b.width, c = b.c0 + i % b.width;
    const int64_t at = b.m * rows * cols + r * cols + c;
    values[kTransposed ? b.m * rows * cols + c * rows + r : at] = numerics::quantize(__bfloat162float(w[at]), scale);
  }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

using Kernel = void (*)(const __nv_bfloat16*, int64_t, int64_t, uint32_t, uint32_t, uint8_t*, float*, const int32_t*);

// One CTA per block: `vector` when w is 16-byte and values 8-byte aligned, else `scalar`.
void launch(Kernel vector, Kernel scalar, const char* name, const __nv_bfloat16* w, int64_t matrices, int64_t rows,
            int64_t cols, uint8_t* values, float* scales, cudaStream_t stream, const int32_t* rows_M) {
  const int64_t row_blocks = numerics::scale_blocks(rows), col_blocks = numerics::scale_blocks(cols);
  const int64_t blocks = matrices * row_blocks * col_blocks;
  if (blocks == 0) return;
  const Kernel kernel = aligned(w, sizeof(uint4)) && aligned(values, sizeof(uint2)) ? vector : scalar;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w, rows, cols, static_cast<uint32_t>(row_blocks),
                                                                 static_cast<uint32_t>(col_blocks), values, scales,
                                                                 rows_M);
  runtime::cuda_check_launch(name);
}

}  // namespace

void launch_weight_blocks(const __nv_bfloat16* w_MRC, int64_t matrices, int64_t rows, int64_t cols,
                          uint8_t* values_MRC, float* scales, cudaStream_t stream, const int32_t* rows_M) {
  launch(weight_blocks_kernel, weight_blocks_unaligned_kernel<false>, "weight_blocks_kernel", w_MRC, matrices, rows,
         cols, values_MRC, scales, stream, rows_M);
}

void launch_weight_blocks_transposed(const __nv_bfloat16* w_MRC, int64_t matrices, int64_t rows, int64_t cols,
                                     uint8_t* values_MCR, float* scales_T, cudaStream_t stream,
                                     const int32_t* rows_M) {
  launch(weight_blocks_transposed_kernel, weight_blocks_unaligned_kernel<true>, "weight_blocks_transposed_kernel",
         w_MRC, matrices, rows, cols, values_MCR, scales_T, stream, rows_M);
}

}  // namespace poise::quant
