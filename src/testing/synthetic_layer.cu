#include "testing/synthetic_layer.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "poise/errors.hpp"
#include "poise/reference.hpp"

namespace poise {
namespace {

void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw DeviceError(std::string("SyntheticLayer: ") + what + ": " + cudaGetErrorString(status));
  }
}

int64_t element_bytes(DType dtype) { return dtype == DType::bf16 ? 2 : 4; }

__host__ __device__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Element i ~ N(0, stddev^2) in bf16: Box-Muller on two 24-bit uniforms of a hash of (key, i).
__global__ void fill_normal_bf16(__nv_bfloat16* out, int64_t count, uint64_t key, float stddev) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint64_t h = splitmix64(key ^ splitmix64(static_cast<uint64_t>(i)));
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * 0x1p-24f;  // (0, 1]: log is finite
    const float u2 = static_cast<float>((h >> 8) & 0xFFFFFFu) * 0x1p-24f;
    out[i] = __float2bfloat16_rn(stddev * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

// One key per (seed, tensor, rank), so no two tensors share values.
uint64_t tensor_key(uint64_t seed, uint64_t tensor, int64_t rank) {
  return splitmix64(splitmix64(seed) ^ (tensor << 32) ^ static_cast<uint64_t>(rank));
}

void fill_normal(void* data, int64_t count, uint64_t key, float stddev) {
  const int64_t blocks = std::min<int64_t>((count + 255) / 256, 132 * 32);
  fill_normal_bf16<<<static_cast<unsigned>(blocks), 256>>>(static_cast<__nv_bfloat16*>(data), count, key, stddev);
  cuda_ok(cudaGetLastError(), "generate");
}

}  // namespace

SyntheticLayer::Tensor SyntheticLayer::allocate(int64_t elements, DType dtype) {
  Tensor t{nullptr, elements, dtype};
  cuda_ok(cudaMalloc(&t.data, size_t(elements * element_bytes(dtype))), "cudaMalloc");
  allocations_.push_back(t.data);
  return t;
}

SyntheticLayer::SyntheticLayer(const Config& c, int64_t ep_size, const std::vector<std::vector<int32_t>>& ids_TK,
                               const std::vector<std::vector<float>>& scores_TK, DType scores_dtype, uint64_t seed)
    : D_(c.hidden_dim), F_(c.intermediate_dim), K_(c.top_k), local_experts_(c.num_local_experts(ep_size)) {
  const int64_t T = c.num_local_input_tokens, D = D_, F = F_, K = K_, E_local = local_experts_;
  const auto R = static_cast<int64_t>(ids_TK.size());
  if (static_cast<int64_t>(scores_TK.size()) != R) throw InvalidArgument("scores_TK", "needs one entry per rank");
  cuda_ok(cudaGetDevice(&device_), "cudaGetDevice");
  try {
    for (int64_t r = 0; r < R; ++r) {
      if (static_cast<int64_t>(ids_TK[r].size()) != T * K || static_cast<int64_t>(scores_TK[r].size()) != T * K) {
        throw InvalidArgument("ids_TK", "rank " + std::to_string(r) + ": needs T*K ids and scores");
      }
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
      fill_normal(t.x.data, t.x.elements, tensor_key(seed, 1, r), 1.0f);
      fill_normal(t.w13.data, t.w13.elements, tensor_key(seed, 2, r), 1.0f / std::sqrt(float(D)));
      fill_normal(t.w2.data, t.w2.elements, tensor_key(seed, 3, r), 1.0f / std::sqrt(float(F)));
      fill_normal(t.grad_out.data, t.grad_out.elements, tensor_key(seed, 4, r), 1.0f);
      cuda_ok(cudaMemcpy(t.ids.data, ids_TK[r].data(), size_t(T * K) * 4, cudaMemcpyHostToDevice), "upload");
      if (scores_dtype == DType::bf16) {
        const std::vector<uint16_t> bits = reference::to_bf16_bits(scores_TK[r]);
        cuda_ok(cudaMemcpy(t.scores.data, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), "upload");
      } else {
        cuda_ok(cudaMemcpy(t.scores.data, scores_TK[r].data(), size_t(T * K) * 4, cudaMemcpyHostToDevice), "upload");
      }
      ranks_.push_back(t);
      ForwardArgs f{.x_TD = t.x.data, .ids_TK = static_cast<const int32_t*>(t.ids.data), .scores_TK = t.scores.data,
                    .scores_dtype = scores_dtype, .w13 = t.w13.data, .w2 = t.w2.data, .out_TD = t.out.data};
      forward_.push_back(f);
      backward_.push_back({.forward = f, .grad_out_TD = t.grad_out.data, .grad_x_TD = t.grad_x.data,
                           .grad_scores_TK = t.grad_scores.data, .grad_w13 = t.grad_w13.data,
                           .grad_w2 = t.grad_w2.data, .accumulate_wgrad = false, .wgrad_dtype = {}});
    }
    cuda_ok(cudaDeviceSynchronize(), "generate");
  } catch (...) {
    for (void* p : allocations_) cudaFree(p);
    throw;
  }
}

SyntheticLayer::~SyntheticLayer() {
  for (void* p : allocations_) cudaFree(p);
}

void SyntheticLayer::poison_outputs() {
  for (const RankTensors& t : ranks_) {
    for (const Tensor* out : {&t.out, &t.grad_x, &t.grad_scores, &t.grad_w13, &t.grad_w2}) {
      cuda_ok(cudaMemset(out->data, 0xff, size_t(out->elements * element_bytes(out->dtype))), "poison");
    }
  }
}

std::vector<float> SyntheticLayer::download(const Tensor& tensor, int64_t first, int64_t count) const {
  // Called from the float64 check's worker threads too: the device is per thread.
  cuda_ok(cudaSetDevice(device_), "cudaSetDevice");
  cuda_ok(cudaDeviceSynchronize(), "synchronize");
  if (first < 0 || count < 0 || first + count > tensor.elements) {
    throw InvalidArgument("SyntheticLayer", "read outside a tensor");
  }
  const char* source = static_cast<const char*>(tensor.data) + first * element_bytes(tensor.dtype);
  if (tensor.dtype == DType::bf16) {
    std::vector<uint16_t> bits(static_cast<size_t>(count));
    cuda_ok(cudaMemcpy(bits.data(), source, bits.size() * 2, cudaMemcpyDeviceToHost), "download");
    return reference::from_bf16_bits(bits);
  }
  std::vector<float> values(static_cast<size_t>(count));
  cuda_ok(cudaMemcpy(values.data(), source, values.size() * 4, cudaMemcpyDeviceToHost), "download");
  return values;
}

std::vector<float> SyntheticLayer::row(Tensor RankTensors::*member, int64_t rank, int64_t t, int64_t width) const {
  return download(ranks_.at(size_t(rank)).*member, t * width, width);
}

void SyntheticLayer::expert_weights(int64_t expert, std::vector<float>& w13_2FD, std::vector<float>& w2_DF) const {
  const RankTensors& owner = ranks_.at(size_t(expert / local_experts_));
  const int64_t slot = expert % local_experts_;
  w13_2FD = download(owner.w13, slot * 2 * F_ * D_, 2 * F_ * D_);
  w2_DF = download(owner.w2, slot * D_ * F_, D_ * F_);
}

}  // namespace poise
