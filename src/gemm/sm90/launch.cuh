// Launching a grouped-GEMM kernel: persistent (as many CTAs or pairs as fit at once), on 2-CTA
// clusters where the epilogue runs on tile pairs, with programmatic dependent launch (the kernel
// sets up while the previous kernel in the stream finishes: ptx/grid_dependency.cuh).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <string>

#include "gemm/sm90/gemm_args.hpp"
#include "gemm/sm90/grouped_gemm.cuh"
#include "poise/errors.hpp"

namespace poise::sm90 {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw DeviceError(std::string(what) + ": " + cudaGetErrorString(err));
}

inline int sm_count(int device) {
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return sms;
}

// Per device, how many clusters of one kernel run at once (0: not asked yet).
using ResidentClusters = std::array<std::atomic<int>, 64>;

// How many clusters of `kernel` run at once on `device`, after opting it into `smem` bytes of shared
// memory; asked of the driver once per kernel and device, remembered in `known` (the opt-in and the
// occupancy query cost more host time than the launch itself, and decode steps are host-bound).
template <class Kernel>
int resident_clusters(Kernel kernel, ResidentClusters& known, int device, uint32_t smem, cudaLaunchConfig_t config,
                      int cluster) {
  if (device < static_cast<int>(known.size())) {
    if (const int clusters = known[device].load(std::memory_order_relaxed); clusters > 0) return clusters;
  }
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(grouped_gemm_kernel)");
  // Persistent: as many clusters as fit at once (one CTA per SM; pairs must share a GPC).
  int clusters = sm_count(device) / cluster;
  if (cluster > 1) {
    config.gridDim = dim3(clusters * cluster);
    check_cuda(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config), "cudaOccupancyMaxActiveClusters");
    if (clusters < 1) throw DeviceError("grouped_gemm_kernel: no cluster of 2 CTAs fits on this device");
  }
  if (device < static_cast<int>(known.size())) known[device].store(clusters, std::memory_order_relaxed);
  return clusters;
}

// kFp8: the FP8 block-scaled kernel (mainloop_fp8.cuh).
template <RowsAre kRows, bool kBMnMajor, class Epilogue, bool kFp8 = false>
void launch(const CUtensorMap& map_a, const WeightMaps& map_b, const GroupedGemmShape& shape,
            const Epilogue& epilogue, cudaStream_t stream) {
  static_assert(Epilogue::kStagingBuffers <= 1, "4 stages leave room for one staging buffer per consumer");
  constexpr int kCluster = Epilogue::kPairedTiles ? 2 : 1;
  auto kernel = grouped_gemm_kernel<kBlockN, kStages, kRows, kBMnMajor, Epilogue, kCluster, kFp8>;
  constexpr uint32_t smem =
      GroupedGemmSmem<kBlockN, kStages, Epilogue::kStagingBuffers, kFp8 && kRows == RowsAre::K>::kTotalBytes;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(kThreadsPerCta);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = kCluster;
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attributes;
  config.numAttrs = 1;  // the occupancy query sees the cluster shape only
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  static ResidentClusters known{};  // this kernel's (one per instantiation of launch)
  const int clusters = resident_clusters(kernel, known, device, smem, config, kCluster);
  config.gridDim = dim3(clusters * kCluster);
  config.numAttrs = 2;
  check_cuda(cudaLaunchKernelEx(&config, kernel, map_a, map_b.own, map_b.replicas, shape, epilogue),
             "grouped_gemm_kernel launch");
}

}  // namespace poise::sm90
