// DeviceLayer: one MoE layer's tensors for every launch rank, on the device, filled from the CPU
// reference engine's inputs. Lets the demo and the GPU tests run the public entry points on exactly
// the inputs the reference engine (the oracle) sees, and read the results back as floats.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "poise/context.hpp"
#include "poise/reference.hpp"
#include "testing/layer_tensors.hpp"

namespace poise {

class DeviceLayer {
 public:
  // inputs_per_rank / grad_out_TD_per_rank: one entry per launch rank. Throws DeviceError on CUDA failures.
  DeviceLayer(const Config& config, int64_t ep_size, const std::vector<reference::RankInputs>& inputs_per_rank,
              const std::vector<std::vector<float>>& grad_out_TD_per_rank, DType scores_dtype);
  DeviceLayer(const DeviceLayer&) = delete;
  DeviceLayer& operator=(const DeviceLayer&) = delete;

  std::span<const ForwardArgs> forward_args() const { return tensors_.forward_args(); }
  std::span<const BackwardArgs> backward_args() const { return tensors_.backward_args(); }

  // Fills every output with NaN bits, so an element the GPU never writes cannot pass a check.
  void poison_outputs() { tensors_.poison_outputs(); }

  // Per rank, as floats (bf16 values widened; grads in the Config's wgrad dtype / the scores dtype).
  std::vector<std::vector<float>> out_TD() const;
  std::vector<std::vector<float>> grad_x_TD() const;
  std::vector<std::vector<float>> grad_scores_TK() const;
  std::vector<std::vector<float>> grad_w13() const;
  std::vector<std::vector<float>> grad_w2() const;

 private:
  using Tensor = LayerTensors::Tensor;
  using RankTensors = LayerTensors::RankTensors;
  std::vector<std::vector<float>> download_all(Tensor RankTensors::*member) const;
  LayerTensors tensors_{"DeviceLayer"};
};

}  // namespace poise
