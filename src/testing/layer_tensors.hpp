// LayerTensors: one MoE layer's device tensors for every launch rank (inputs, outputs, gradients)
// and the routed_experts arguments over them. What DeviceLayer (filled from the host) and
// SyntheticLayer (generated on the device) share; they differ only in how the inputs get there.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "poise/context.hpp"

namespace poise {

class LayerTensors {
 public:
  struct Tensor {
    void* data = nullptr;
    int64_t elements = 0;
    DType dtype = DType::bf16;
  };
  struct RankTensors {
    Tensor x, ids, scores, w13, w2, out, grad_out, grad_x, grad_scores, grad_w13, grad_w2;
  };

  // `owner` starts every error's message ("DeviceLayer: cudaMalloc: ...").
  explicit LayerTensors(std::string owner) : owner_(std::move(owner)) {}
  ~LayerTensors();
  LayerTensors(const LayerTensors&) = delete;
  LayerTensors& operator=(const LayerTensors&) = delete;

  // The next rank's tensors and call arguments: ids as int32 words, scores and grad_scores in
  // scores_dtype, the weight gradients in the Config's wgrad dtype, the rest bf16. Not filled.
  RankTensors add_rank(const Config& config, int64_t ep_size, DType scores_dtype);

  const std::vector<RankTensors>& ranks() const { return ranks_; }
  std::span<const ForwardArgs> forward_args() const { return forward_; }
  std::span<const BackwardArgs> backward_args() const { return backward_; }

  // Fills every output with NaN bits, so an element the GPU never writes cannot pass a check.
  void poison_outputs();

  // Host floats -> the tensor's bf16 bits or fp32, from its first element.
  void upload(const Tensor& tensor, const std::vector<float>& values) const;
  // The tensor's elements as int32 words, copied verbatim (ids).
  void upload_words(const Tensor& tensor, const int32_t* words) const;
  // `count` elements from `first` as floats (bf16 widened). The caller synchronizes first.
  std::vector<float> download(const Tensor& tensor, int64_t first, int64_t count) const;

  // Throws DeviceError "<owner>: <what>: <CUDA error>" unless status is cudaSuccess.
  void check(cudaError_t status, const char* what) const;

 private:
  Tensor allocate(int64_t elements, DType dtype);

  std::string owner_;
  std::vector<RankTensors> ranks_;
  std::vector<void*> allocations_;
  std::vector<ForwardArgs> forward_;
  std::vector<BackwardArgs> backward_;
};

}  // namespace poise
