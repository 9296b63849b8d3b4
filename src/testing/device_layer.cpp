#include "testing/device_layer.hpp"

#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "poise/errors.hpp"

namespace poise {
namespace {

void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw DeviceError(std::string("DeviceLayer: ") + what + ": " + cudaGetErrorString(status));
}

size_t element_bytes(DType dtype) { return dtype == DType::bf16 ? 2 : 4; }

}  // namespace

DeviceLayer::Tensor DeviceLayer::allocate(int64_t elements, DType dtype) {
  Tensor t{nullptr, elements, dtype};
  cuda_ok(cudaMalloc(&t.data, size_t(elements) * element_bytes(dtype)), "cudaMalloc");
  allocations_.push_back(t.data);
  return t;
}

// Host floats -> device bf16 bits or fp32 (ids travel as fp32-sized int32 words, copied verbatim).
static void upload_floats(void* device, const std::vector<float>& values, DType dtype) {
  if (dtype == DType::bf16) {
    const std::vector<uint16_t> bits = reference::to_bf16_bits(values);
    cuda_ok(cudaMemcpy(device, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), "upload");
  } else {
    cuda_ok(cudaMemcpy(device, values.data(), values.size() * 4, cudaMemcpyHostToDevice), "upload");
  }
}

DeviceLayer::DeviceLayer(const Config& c, int64_t ep_size, const std::vector<reference::RankInputs>& inputs,
                         const std::vector<std::vector<float>>& grad_out, DType scores_dtype) {
  const int64_t T = c.num_local_input_tokens, D = c.hidden_dim, F = c.intermediate_dim, K = c.top_k;
  const int64_t E_local = c.num_local_experts(ep_size);
  if (inputs.size() != grad_out.size()) throw InvalidArgument("grad_out_TD_per_rank", "needs one entry per rank");
  try {
    for (size_t r = 0; r < inputs.size(); ++r) {
      RankTensors t;
      t.x = allocate(T * D, DType::bf16);
      t.ids = allocate(T * K, DType::fp32);  // int32 words
      t.scores = allocate(T * K, scores_dtype);
      t.w13 = allocate(E_local * 2 * F * D, DType::bf16);
      t.w2 = allocate(E_local * D * F, DType::bf16);
      t.out = allocate(T * D, DType::bf16);
      t.grad_out = allocate(T * D, DType::bf16);
      t.grad_x = allocate(T * D, DType::bf16);
      t.grad_scores = allocate(T * K, scores_dtype);
      t.grad_w13 = allocate(E_local * 2 * F * D, c.wgrad_dtype);
      t.grad_w2 = allocate(E_local * D * F, c.wgrad_dtype);
      upload_floats(t.x.data, inputs[r].x_TD, DType::bf16);
      cuda_ok(cudaMemcpy(t.ids.data, inputs[r].ids_TK.data(), size_t(T * K) * 4, cudaMemcpyHostToDevice), "upload");
      upload_floats(t.scores.data, inputs[r].scores_TK, scores_dtype);
      upload_floats(t.w13.data, inputs[r].w13, DType::bf16);
      upload_floats(t.w2.data, inputs[r].w2, DType::bf16);
      upload_floats(t.grad_out.data, grad_out[r], DType::bf16);
      ranks_.push_back(t);
      ForwardArgs f{.x_TD = t.x.data, .ids_TK = static_cast<const int32_t*>(t.ids.data), .scores_TK = t.scores.data,
                    .scores_dtype = scores_dtype, .w13 = t.w13.data, .w2 = t.w2.data, .out_TD = t.out.data};
      forward_.push_back(f);
      backward_.push_back({.forward = f, .grad_out_TD = t.grad_out.data, .grad_x_TD = t.grad_x.data,
                           .grad_scores_TK = t.grad_scores.data, .grad_w13 = t.grad_w13.data,
                           .grad_w2 = t.grad_w2.data, .accumulate_wgrad = false, .wgrad_dtype = {}});
    }
  } catch (...) {
    for (void* p : allocations_) cudaFree(p);
    throw;
  }
}

DeviceLayer::~DeviceLayer() {
  for (void* p : allocations_) cudaFree(p);
}

void DeviceLayer::poison_outputs() {
  for (const RankTensors& t : ranks_) {
    for (const Tensor* out : {&t.out, &t.grad_x, &t.grad_scores, &t.grad_w13, &t.grad_w2}) {
      cuda_ok(cudaMemset(out->data, 0xff, size_t(out->elements) * element_bytes(out->dtype)), "poison");
    }
  }
}

std::vector<std::vector<float>> DeviceLayer::download_all(Tensor RankTensors::*member) const {
  cuda_ok(cudaDeviceSynchronize(), "synchronize");
  std::vector<std::vector<float>> per_rank;
  for (const RankTensors& t : ranks_) {
    const Tensor& tensor = t.*member;
    if (tensor.dtype == DType::bf16) {
      std::vector<uint16_t> bits(size_t(tensor.elements));
      cuda_ok(cudaMemcpy(bits.data(), tensor.data, bits.size() * 2, cudaMemcpyDeviceToHost), "download");
      per_rank.push_back(reference::from_bf16_bits(bits));
    } else {
      std::vector<float> values(size_t(tensor.elements));
      cuda_ok(cudaMemcpy(values.data(), tensor.data, values.size() * 4, cudaMemcpyDeviceToHost), "download");
      per_rank.push_back(std::move(values));
    }
  }
  return per_rank;
}

std::vector<std::vector<float>> DeviceLayer::out_TD() const { return download_all(&RankTensors::out); }
std::vector<std::vector<float>> DeviceLayer::grad_x_TD() const { return download_all(&RankTensors::grad_x); }
std::vector<std::vector<float>> DeviceLayer::grad_scores_TK() const { return download_all(&RankTensors::grad_scores); }
std::vector<std::vector<float>> DeviceLayer::grad_w13() const { return download_all(&RankTensors::grad_w13); }
std::vector<std::vector<float>> DeviceLayer::grad_w2() const { return download_all(&RankTensors::grad_w2); }

}  // namespace poise
