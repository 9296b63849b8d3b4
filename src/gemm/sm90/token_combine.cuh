// The top-k combine as a side job of a WGRAD GEMM (expert_mlp.hpp, TokenCombine): the producer
// warpgroup's warps 1-3, idle in a GEMM (one thread of warp 0 issues every TMA load), sum each
// token's K grouped rows into its token row while the consumers compute. The rows come from an
// earlier kernel in the stream (DGRAD W13), so the combine needs nothing from the GEMM it rides in.
//
// An item is one column chunk of one token: K row pieces of chunk_bytes. Warp 1 brings an item's
// pieces into a shared-memory slot by bulk copies (lane k copies row k's piece; the slot's "full"
// barrier counts the bytes), so the bytes in flight hold no registers: the producer warpgroup runs
// on 40, and v18c, which loaded rows into registers from these warps, kept only ~3 KiB per SM in
// flight and outlasted the GEMM. Warps 2-3 sum the pieces, fp32 in k order from 0 (the standalone
// combine's order: the same bits), store the token's chunk and free the slot. The WGRAD kernel's
// shared memory leaves room for 2 slots of 2 KiB only.
#pragma once

#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cstdint>

#include "gemm/sm90/ptx/mbarrier.cuh"
#include "gemm/sm90/ptx/shared_memory.cuh"

namespace poise::sm90 {

struct TokenCombineJob {
  const int32_t* row_of_tk = nullptr;  // [T * K]
  const uint8_t* rows_RD = nullptr;    // bf16 rows of row_bytes
  uint8_t* out_TD = nullptr;           // bf16 token rows; nullptr: no side job
  const float* partials_RP = nullptr;  // nullable: per-row pieces summed into sums_TK
  float* sums_TK = nullptr;
  int32_t tokens = 0, top_k = 0, row_bytes = 0, partials = 0;
  int32_t chunk_bytes = 0;  // a multiple of 128 with top_k * chunk_bytes <= kSideSlotBytes
  int32_t chunks = 0;       // ceil(row_bytes / chunk_bytes)
  int32_t rows = 0;         // R: a row index outside [0, rows) is read nowhere and recorded as a fault
};

inline constexpr int kSideSlots = 2;
inline constexpr uint32_t kSideSlotBytes = 2048;
inline constexpr int kSideSummers = 64;  // warps 2-3 of the producer warpgroup

// What a piece of a row index out of range is copied from.
static __device__ __align__(128) uint8_t g_zero_piece[kSideSlotBytes];

// The side job's shared memory: kSideSlots slots of kSideSlotBytes, then [full][empty] barriers.
inline constexpr uint32_t kSideBytes = kSideSlots * kSideSlotBytes + 2 * kSideSlots * sizeof(uint64_t);

// Initialised by one thread before the CTA's first barrier sync.
__device__ __forceinline__ void init_token_combine(uint8_t* side) {
  uint64_t* full = reinterpret_cast<uint64_t*>(side + kSideSlots * kSideSlotBytes);
  for (int s = 0; s < kSideSlots; ++s) {
    ptx::mbarrier_init(&full[s], 1);
    ptx::mbarrier_init(&full[kSideSlots + s], kSideSummers / 32);
  }
}

// Run by producer warps 1-3 (`warp` 1..3) of every CTA, on a contiguous share of the tokens: warp
// 1 reads a token's K row indices once for all its chunks (the next token's while this one's are
// copied: an index read in front of every copy doubled the slots' round trip, v23b), and sums
// its score pieces while the slots are busy; warps 2-3 sum the pieces of each chunk.
__device__ __forceinline__ void run_token_combine(const TokenCombineJob& job, uint8_t* side, int warp, int lane) {
  uint64_t* full = reinterpret_cast<uint64_t*>(side + kSideSlots * kSideSlotBytes);
  uint64_t* empty = full + kSideSlots;
  const int32_t share = (job.tokens + gridDim.x - 1) / gridDim.x;
  const int32_t t_begin = min(job.tokens, static_cast<int32_t>(blockIdx.x) * share);
  const int32_t t_end = min(job.tokens, t_begin + share);
  uint32_t j = 0;  // items (token, chunk) of this CTA so far
  if (warp == 1) {
    const bool copies = lane < job.top_k;
    // Row -1 stands for an index outside [0, rows): that piece is copied from zeros instead and
    // its score sum is 0; the first such index of the launch is recorded (take_pipeline_fault).
    auto row_of = [&](int32_t t) -> int32_t {
      if (!copies || t >= t_end) return 0;
      const int32_t row = job.row_of_tk[static_cast<int64_t>(t) * job.top_k + lane];
      if (static_cast<uint32_t>(row) < static_cast<uint32_t>(job.rows)) return row;
      ptx::record_fault(ptx::PipelineFaultWord::kBadRow);
      return -1;
    };
    int32_t next_row = row_of(t_begin);
    for (int32_t t = t_begin; t < t_end; ++t) {
      const int32_t row = next_row;
      next_row = row_of(t + 1);
      const bool reads = copies && row >= 0;
      for (int32_t c = 0; c < job.chunks; ++c, ++j) {
        const int s = j % kSideSlots;
        const int32_t offset = c * job.chunk_bytes;
        const uint32_t bytes = static_cast<uint32_t>(min(job.chunk_bytes, job.row_bytes - offset));
        ptx::mbarrier_wait(&empty[s], ((j / kSideSlots) & 1) ^ 1);  // freed (at once the first time)
        if (lane == 0) ptx::mbarrier_arrive_expect_tx(&full[s], job.top_k * bytes);
        if (copies) {
          const uint8_t* src = reads ? job.rows_RD + static_cast<int64_t>(row) * job.row_bytes + offset : g_zero_piece;
          cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global,
                                   side + s * kSideSlotBytes + lane * job.chunk_bytes, src, bytes, &full[s]);
        }
        if (c == 0 && copies && job.partials_RP != nullptr) {
          float sum = 0.0f;
          if (reads) {
#pragma unroll 4
            for (int32_t p = 0; p < job.partials; ++p)
              sum += job.partials_RP[static_cast<int64_t>(row) * job.partials + p];
          }
          job.sums_TK[static_cast<int64_t>(t) * job.top_k + lane] = sum;
        }
      }
    }
    return;
  }
  const uint32_t summer = (warp - 2) * 32 + lane;
  for (int32_t t = t_begin; t < t_end; ++t) {
    for (int32_t c = 0; c < job.chunks; ++c, ++j) {
      const int s = j % kSideSlots;
      const int32_t offset = c * job.chunk_bytes;
      const uint32_t bytes = static_cast<uint32_t>(min(job.chunk_bytes, job.row_bytes - offset));
      ptx::mbarrier_wait(&full[s], (j / kSideSlots) & 1);
      const uint32_t base = ptx::shared_address(side + s * kSideSlotBytes);
      for (uint32_t u = 4 * summer; u < bytes; u += 4 * kSideSummers) {  // 2 columns per step
        float lo = 0.0f, hi = 0.0f;
        for (int32_t k = 0; k < job.top_k; ++k) {
          const uint32_t v = ptx::ld_shared_b32(base + k * job.chunk_bytes + u);
          const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(&v);
          lo += __low2float(pair);
          hi += __high2float(pair);
        }
        const __nv_bfloat162 out = __floats2bfloat162_rn(lo, hi);
        *reinterpret_cast<__nv_bfloat162*>(job.out_TD + static_cast<int64_t>(t) * job.row_bytes + offset + u) = out;
      }
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&empty[s]);
    }
  }
}

}  // namespace poise::sm90
