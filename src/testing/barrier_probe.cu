#include "testing/barrier_probe.hpp"

#include "runtime/cuda_check.hpp"
#include "comm/transport_device.cuh"

namespace poise::comm {

using runtime::cuda_check_launch;
namespace {

__host__ __device__ uint64_t probe_tag(int round, int rank, int block) {
  return (static_cast<uint64_t>(round + 1) << 32) | (static_cast<uint64_t>(rank) << 16) |
         static_cast<uint64_t>(block);
}

__global__ void probe_round_kernel(const PeerTable* tables, int blocks_per_rank, int round, int absent_rank) {
  const PeerTable& pt = tables[blockIdx.x / blocks_per_rank];
  const int block = blockIdx.x % blocks_per_rank;
  if (pt.rank == absent_rank) return;  // a crashed peer: no puts, no arrival
  if (threadIdx.x == 0 && !rank_failed(pt)) {
    const int next = (pt.rank + 1) % pt.world;
    uint64_t* slots = peer_ptr<uint64_t>(pt, next, kSignalBytes);
    slots[pt.rank * blocks_per_rank + block] = probe_tag(round, pt.rank, block);
  }
  arrive_then_barrier(pt, blocks_per_rank, Phase::barrier_probe);
}

__global__ void probe_check_kernel(const PeerTable* tables, int blocks_per_rank, int round, int* mismatches) {
  const PeerTable& pt = tables[blockIdx.x];
  const int prev = (pt.rank + pt.world - 1) % pt.world;
  const uint64_t* slots = peer_ptr<uint64_t>(pt, pt.rank, kSignalBytes);
  for (int b = threadIdx.x; b < blocks_per_rank; b += blockDim.x) {
    if (slots[prev * blocks_per_rank + b] != probe_tag(round, prev, b)) atomicAdd(mismatches, 1);
  }
}

}  // namespace

size_t barrier_probe_workspace_bytes(int world, int blocks_per_rank) {
  return kSignalBytes + sizeof(uint64_t) * static_cast<size_t>(world) * blocks_per_rank;
}

void launch_barrier_probe_round(const Transport& t, int blocks_per_rank, int round, int absent_rank,
                                cudaStream_t stream) {
  probe_round_kernel<<<t.launch_ranks() * blocks_per_rank, 32, 0, stream>>>(t.device_tables(), blocks_per_rank,
                                                                            round, absent_rank);
  cuda_check_launch("probe_round_kernel");
}

void launch_barrier_probe_check(const Transport& t, int blocks_per_rank, int round, int* mismatches_device,
                                cudaStream_t stream) {
  probe_check_kernel<<<t.launch_ranks(), 128, 0, stream>>>(t.device_tables(), blocks_per_rank, round,
                                                          mismatches_device);
  cuda_check_launch("probe_check_kernel");
}

}  // namespace poise::comm
