// SyntheticLayer: one MoE layer's tensors for every launch rank, on the device, for layers too
// large to build on the host: x, the weights and grad_out are generated on the GPU from the seed (a
// hash of each element's index), the routing (ids, scores: small) comes from the host. Rows and
// single experts can be read back, for a float64 check of a sample of tokens.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "poise/context.hpp"
#include "testing/layer_tensors.hpp"

namespace poise {

class SyntheticLayer {
 public:
  // ids_TK / scores_TK: [R][T*K] (scores as floats, bf16 values when scores_dtype is bf16).
  // x ~ N(0,1), W13 ~ N(0,1/D), W2 ~ N(0,1/F), grad_out ~ N(0,1), bf16, the same for the same seed.
  // Throws DeviceError on CUDA failures.
  SyntheticLayer(const Config& config, int64_t ep_size, const std::vector<std::vector<int32_t>>& ids_TK,
                 const std::vector<std::vector<float>>& scores_TK, DType scores_dtype, uint64_t seed);
  SyntheticLayer(const SyntheticLayer&) = delete;
  SyntheticLayer& operator=(const SyntheticLayer&) = delete;

  std::span<const ForwardArgs> forward_args() const { return tensors_.forward_args(); }
  std::span<const BackwardArgs> backward_args() const { return tensors_.backward_args(); }

  // Fills every output with NaN bits, so an element the GPU never writes cannot pass a check.
  void poison_outputs() { tensors_.poison_outputs(); }

  // Row t of rank r as floats (waits for the device first).
  std::vector<float> x_row(int64_t rank, int64_t t) const { return row(&RankTensors::x, rank, t, D_); }
  std::vector<float> grad_out_row(int64_t rank, int64_t t) const { return row(&RankTensors::grad_out, rank, t, D_); }
  std::vector<float> out_row(int64_t rank, int64_t t) const { return row(&RankTensors::out, rank, t, D_); }
  std::vector<float> grad_x_row(int64_t rank, int64_t t) const { return row(&RankTensors::grad_x, rank, t, D_); }
  std::vector<float> grad_scores_row(int64_t rank, int64_t t) const {
    return row(&RankTensors::grad_scores, rank, t, K_);
  }
  // The bf16 weights of global expert e from its owner: w13 [2F, D], w2 [D, F] (a reference::ExpertWeightsFn).
  void expert_weights(int64_t expert, std::vector<float>& w13_2FD, std::vector<float>& w2_DF) const;

 private:
  using Tensor = LayerTensors::Tensor;
  using RankTensors = LayerTensors::RankTensors;
  std::vector<float> download(const Tensor& tensor, int64_t first, int64_t count) const;
  std::vector<float> row(Tensor RankTensors::*member, int64_t rank, int64_t t, int64_t width) const;

  int device_ = 0;
  int64_t D_ = 0, F_ = 0, K_ = 0, local_experts_ = 0;
  LayerTensors tensors_{"SyntheticLayer"};
};

}  // namespace poise
