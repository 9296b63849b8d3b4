// The streamed row gather (expert_mlp.hpp, gather_rows_streamed): token rows into expert-grouped
// order, published block by block for the GEMM enqueued after it (streamed_rows.cuh).
//
// The valid rows are walked in expert order (the order the rows-as-M GEMMs take their tiles), row
// i of that walk by warp i % warps, so the first row blocks are complete after one row copy per
// warp and later ones follow at the copy rate. The GEMM's CTAs cannot share an SM with these
// (they use all its registers): they take the other SMs at once and these as they finish.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cuda/ptx>
#include <cstdint>

#include "gemm/sm90/ptx/grid_dependency.cuh"
#include "gemm/sm90/ptx/mbarrier.cuh"
#include "gemm/sm90/streamed_rows.cuh"
#include "gemm/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

inline constexpr int kGatherThreads = 1024;
inline constexpr int kGatherWarps = kGatherThreads / 32;
inline constexpr int kGatherVectorsInFlight = 8;  // 16-byte loads per lane before its stores

struct RowGatherParams {
  const int32_t* row_offsets_E;
  const int32_t* row_counts_E;
  int32_t num_experts;
  int32_t blocks;  // B: row blocks of the grouped buffers
  const int32_t* token_of_row_R;
  int32_t tokens;
  int32_t vecs;  // 16-byte vectors per row
  const uint4* src_TD;
  uint4* dst_RD;
  uint32_t* words;  // StreamedRowsWords
};

__global__ void __launch_bounds__(kGatherThreads, 1) streamed_row_gather_kernel(RowGatherParams p) {
  constexpr int kItems = (kMaxExperts + kGatherThreads - 1) / kGatherThreads;
  using Scan = cub::BlockScan<int32_t, kGatherThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int32_t first_valid_E[kMaxExperts + 1];  // index of expert e's first row in the walk
  __shared__ int2 rows_E[kMaxExperts];                // (offset, count)
  __shared__ uint32_t published;
  // Offsets, counts, tokens and the source rows are the previous kernels' outputs.
  ptx::wait_for_prerequisite_grids();
  int32_t counts[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int e = threadIdx.x * kItems + j;
    counts[j] = e < p.num_experts ? p.row_counts_E[e] : 0;
    if (e < p.num_experts) rows_E[e] = make_int2(p.row_offsets_E[e], counts[j]);
  }
  int32_t total = 0;
  Scan(scan_storage).ExclusiveSum(counts, counts, total);
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int e = threadIdx.x * kItems + j;
    if (e < p.num_experts) first_valid_E[e] = counts[j];
  }
  // The generation is read before the GEMM may start (it advances it at its end).
  if (threadIdx.x == 0) {
    first_valid_E[p.num_experts] = total;
    published = ld_relaxed_gpu(p.words + StreamedRowsWords::kGeneration) + 1;
  }
  __syncthreads();
  ptx::allow_dependent_grids();
  const uint32_t generation = published;
  const int lane = threadIdx.x % 32;
  const int32_t warps = gridDim.x * kGatherWarps;
  int e = 0;
  for (int32_t i = blockIdx.x * kGatherWarps + threadIdx.x / 32; i < total; i += warps) {
    while (first_valid_E[e + 1] <= i) ++e;  // i only grows: the expert only moves forward
    const int2 expert_rows = rows_E[e];
    const int32_t local = i - first_valid_E[e];
    const int32_t r = expert_rows.x + local;
    const int32_t token = p.token_of_row_R[r];
    const bool bad_token = token < 0 || token >= p.tokens;
    if (bad_token && lane == 0) ptx::record_fault(ptx::PipelineFaultWord::kBadToken);
    const uint4* src = p.src_TD + static_cast<int64_t>(bad_token ? 0 : token) * p.vecs;
    uint4* dst = p.dst_RD + static_cast<int64_t>(r) * p.vecs;
    for (int32_t v0 = lane; v0 < p.vecs; v0 += 32 * kGatherVectorsInFlight) {
      uint4 piece[kGatherVectorsInFlight];
#pragma unroll
      for (int u = 0; u < kGatherVectorsInFlight; ++u) {
        const int32_t v = v0 + 32 * u;
        piece[u] = v < p.vecs && !bad_token ? __ldg(src + v) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kGatherVectorsInFlight; ++u)
        if (v0 + 32 * u < p.vecs) dst[v0 + 32 * u] = piece[u];
    }
    // This lane's stores, ordered before the GEMM's TMA reads of them (through the publication).
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
    __syncwarp();
    if (lane == 0) {
      const int32_t block = r / kTileM;
      const int32_t rows_in_block = min(kTileM, expert_rows.y - local / kTileM * kTileM);
      uint32_t* done = p.words + StreamedRowsWords::kBlocks + p.blocks + block;
      if (atom_add_acq_rel_gpu(done, 1u) + 1 == static_cast<uint32_t>(rows_in_block)) {
        *done = 0;  // the next call's writer starts after this launch completes
        st_release_gpu(p.words + StreamedRowsWords::kBlocks + block, generation);
      }
    }
  }
}

}  // namespace poise::sm90
