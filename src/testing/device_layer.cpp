#include "testing/device_layer.hpp"

#include "poise/errors.hpp"

namespace poise {

DeviceLayer::DeviceLayer(const Config& c, int64_t ep_size, const std::vector<reference::RankInputs>& inputs,
                         const std::vector<std::vector<float>>& grad_out, DType scores_dtype) {
  if (inputs.size() != grad_out.size()) throw InvalidArgument("grad_out_TD_per_rank", "needs one entry per rank");
  for (size_t r = 0; r < inputs.size(); ++r) {
    const RankTensors t = tensors_.add_rank(c, ep_size, scores_dtype);
    tensors_.upload(t.x, inputs[r].x_TD);
    tensors_.upload_words(t.ids, inputs[r].ids_TK.data());
    tensors_.upload(t.scores, inputs[r].scores_TK);
    tensors_.upload(t.w13, inputs[r].w13);
    tensors_.upload(t.w2, inputs[r].w2);
    tensors_.upload(t.grad_out, grad_out[r]);
  }
}

std::vector<std::vector<float>> DeviceLayer::download_all(Tensor RankTensors::*member) const {
  tensors_.check(cudaDeviceSynchronize(), "synchronize");
  std::vector<std::vector<float>> per_rank;
  for (const RankTensors& t : tensors_.ranks()) {
    const Tensor& tensor = t.*member;
    per_rank.push_back(tensors_.download(tensor, 0, tensor.elements));
  }
  return per_rank;
}

std::vector<std::vector<float>> DeviceLayer::out_TD() const { return download_all(&RankTensors::out); }
std::vector<std::vector<float>> DeviceLayer::grad_x_TD() const { return download_all(&RankTensors::grad_x); }
std::vector<std::vector<float>> DeviceLayer::grad_scores_TK() const { return download_all(&RankTensors::grad_scores); }
std::vector<std::vector<float>> DeviceLayer::grad_w13() const { return download_all(&RankTensors::grad_w13); }
std::vector<std::vector<float>> DeviceLayer::grad_w2() const { return download_all(&RankTensors::grad_w2); }

}  // namespace poise
