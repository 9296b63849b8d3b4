#include "testing/synthetic_layer.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "poise/errors.hpp"

namespace poise {
namespace {

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

void fill_normal(const LayerTensors& tensors, const LayerTensors::Tensor& t, uint64_t key, float stddev) {
  const int64_t blocks = std::min<int64_t>((t.elements + 255) / 256, 132 * 32);
  fill_normal_bf16<<<static_cast<unsigned>(blocks), 256>>>(static_cast<__nv_bfloat16*>(t.data), t.elements, key,
                                                            stddev);
  tensors.check(cudaGetLastError(), "generate");
}

}  // namespace

SyntheticLayer::SyntheticLayer(const Config& c, int64_t ep_size, const std::vector<std::vector<int32_t>>& ids_TK,
                               const std::vector<std::vector<float>>& scores_TK, DType scores_dtype, uint64_t seed)
    : D_(c.hidden_dim), F_(c.intermediate_dim), K_(c.top_k), local_experts_(c.num_local_experts(ep_size)) {
  const int64_t T = c.num_local_input_tokens, D = D_, F = F_, K = K_;
  const auto R = static_cast<int64_t>(ids_TK.size());
  if (static_cast<int64_t>(scores_TK.size()) != R) throw InvalidArgument("scores_TK", "needs one entry per rank");
  tensors_.check(cudaGetDevice(&device_), "cudaGetDevice");
  for (int64_t r = 0; r < R; ++r) {
    if (static_cast<int64_t>(ids_TK[r].size()) != T * K || static_cast<int64_t>(scores_TK[r].size()) != T * K) {
      throw InvalidArgument("ids_TK", "rank " + std::to_string(r) + ": needs T*K ids and scores");
    }
    const RankTensors t = tensors_.add_rank(c, ep_size, scores_dtype);
    fill_normal(tensors_, t.x, tensor_key(seed, 1, r), 1.0f);
    fill_normal(tensors_, t.w13, tensor_key(seed, 2, r), 1.0f / std::sqrt(float(D)));
    fill_normal(tensors_, t.w2, tensor_key(seed, 3, r), 1.0f / std::sqrt(float(F)));
    fill_normal(tensors_, t.grad_out, tensor_key(seed, 4, r), 1.0f);
    tensors_.upload_words(t.ids, ids_TK[r].data());
    tensors_.upload(t.scores, scores_TK[r]);
  }
  tensors_.check(cudaDeviceSynchronize(), "generate");
}

std::vector<float> SyntheticLayer::download(const Tensor& tensor, int64_t first, int64_t count) const {
  // Called from the float64 check's worker threads too: the device is per thread.
  tensors_.check(cudaSetDevice(device_), "cudaSetDevice");
  tensors_.check(cudaDeviceSynchronize(), "synchronize");
  return tensors_.download(tensor, first, count);
}

std::vector<float> SyntheticLayer::row(Tensor RankTensors::*member, int64_t rank, int64_t t, int64_t width) const {
  return download(tensors_.ranks().at(size_t(rank)).*member, t * width, width);
}

void SyntheticLayer::expert_weights(int64_t expert, std::vector<float>& w13_2FD, std::vector<float>& w2_DF) const {
  const RankTensors& owner = tensors_.ranks().at(size_t(expert / local_experts_));
  const int64_t slot = expert % local_experts_;
  w13_2FD = download(owner.w13, slot * 2 * F_ * D_, 2 * F_ * D_);
  w2_DF = download(owner.w2, slot * D_ * F_, D_ * F_);
}

}  // namespace poise
