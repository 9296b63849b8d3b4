#include "testing/layer_tensors.hpp"

#include "poise/errors.hpp"
#include "poise/reference.hpp"

namespace poise {
namespace {

size_t element_bytes(DType dtype) { return dtype == DType::bf16 ? 2 : 4; }

}  // namespace

LayerTensors::~LayerTensors() {
  for (void* p : allocations_) cudaFree(p);
}

void LayerTensors::check(cudaError_t status, const char* what) const {
  if (status != cudaSuccess) throw DeviceError(owner_ + ": " + what + ": " + cudaGetErrorString(status));
}

LayerTensors::Tensor LayerTensors::allocate(int64_t elements, DType dtype) {
  Tensor t{nullptr, elements, dtype};
  check(cudaMalloc(&t.data, size_t(elements) * element_bytes(dtype)), "cudaMalloc");
  allocations_.push_back(t.data);
  return t;
}

LayerTensors::RankTensors LayerTensors::add_rank(const Config& c, int64_t ep_size, DType scores_dtype) {
  const int64_t T = c.num_local_input_tokens, D = c.hidden_dim, F = c.intermediate_dim, K = c.top_k;
  const int64_t E_local = c.num_local_experts(ep_size);
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
  ranks_.push_back(t);
  ForwardArgs f{.x_TD = t.x.data, .ids_TK = static_cast<const int32_t*>(t.ids.data), .scores_TK = t.scores.data,
                .scores_dtype = scores_dtype, .w13 = t.w13.data, .w2 = t.w2.data, .out_TD = t.out.data};
  forward_.push_back(f);
  backward_.push_back({.forward = f, .grad_out_TD = t.grad_out.data, .grad_x_TD = t.grad_x.data,
                       .grad_scores_TK = t.grad_scores.data, .grad_w13 = t.grad_w13.data,
                       .grad_w2 = t.grad_w2.data, .accumulate_wgrad = false, .wgrad_dtype = {}});
  return t;
}

void LayerTensors::poison_outputs() {
  for (const RankTensors& t : ranks_) {
    for (const Tensor* out : {&t.out, &t.grad_x, &t.grad_scores, &t.grad_w13, &t.grad_w2}) {
      check(cudaMemset(out->data, 0xff, size_t(out->elements) * element_bytes(out->dtype)), "poison");
    }
  }
}

void LayerTensors::upload(const Tensor& tensor, const std::vector<float>& values) const {
  if (tensor.dtype == DType::bf16) {
    const std::vector<uint16_t> bits = reference::to_bf16_bits(values);
    check(cudaMemcpy(tensor.data, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), "upload");
  } else {
    check(cudaMemcpy(tensor.data, values.data(), values.size() * 4, cudaMemcpyHostToDevice), "upload");
  }
}

void LayerTensors::upload_words(const Tensor& tensor, const int32_t* words) const {
  check(cudaMemcpy(tensor.data, words, size_t(tensor.elements) * 4, cudaMemcpyHostToDevice), "upload");
}

std::vector<float> LayerTensors::download(const Tensor& tensor, int64_t first, int64_t count) const {
  if (first < 0 || count < 0 || first + count > tensor.elements) throw InvalidArgument(owner_, "read outside a tensor");
  const char* source = static_cast<const char*>(tensor.data) + first * int64_t(element_bytes(tensor.dtype));
  if (tensor.dtype == DType::bf16) {
    std::vector<uint16_t> bits(static_cast<size_t>(count));
    check(cudaMemcpy(bits.data(), source, bits.size() * 2, cudaMemcpyDeviceToHost), "download");
    return reference::from_bf16_bits(bits);
  }
  std::vector<float> values(static_cast<size_t>(count));
  check(cudaMemcpy(values.data(), source, values.size() * 4, cudaMemcpyDeviceToHost), "download");
  return values;
}

}  // namespace poise
