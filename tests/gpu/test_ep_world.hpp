// EpWorld: one test world of R virtual ranks: a StagedPipeline, random inputs per rank (host and
// device copies), poisoned outputs, and the float64 model's answer.
#pragma once

#include <functional>
#include <memory>

#include "pipeline/staged_pipeline.hpp"
#include "gpu_test_support.hpp"
#include "test_ep_support.hpp"

namespace poise::ep::testing {

struct LayerCase {
  int R, T, D, F, E, K;
  Routing routing = Routing::random;
  double capacity_factor = 2.0;
  Activation activation = Activation::swiglu;
  DType scores = DType::fp32;
  bool accumulate = false;
  double swiglu_limit = 7.0;
  W13Layout layout = W13Layout::gate_up_blocked;  // the device weights' row order (the model is blocked)
  DType wgrad = DType::fp32;                      // Config::wgrad_dtype
};

inline std::string case_name(const LayerCase& c) {
  return "R" + std::to_string(c.R) + "_T" + std::to_string(c.T) + "_D" + std::to_string(c.D) + "_F" +
         std::to_string(c.F) + "_E" + std::to_string(c.E) + "_K" + std::to_string(c.K) + "_" + to_string(c.routing) +
         (c.activation == Activation::swiglu_clamped ? "_clamped" : "") +
         (c.scores == DType::bf16 ? "_bf16scores" : "") + (c.accumulate ? "_accumulate" : "") +
         (c.layout == W13Layout::gate_up_interleaved ? "_interleaved" : "") +
         (c.wgrad == DType::bf16 ? "_bf16wgrad" : "");
}

inline Config make_config(const LayerCase& c) {
  Config cfg;
  cfg.num_local_input_tokens = c.T;
  cfg.hidden_dim = c.D;
  cfg.intermediate_dim = c.F;
  cfg.top_k = c.K;
  cfg.num_experts = c.E;
  cfg.activation = c.activation;
  cfg.swiglu_limit = c.swiglu_limit;
  cfg.balance = Balance::capacity;
  cfg.receive_capacity_factor = c.capacity_factor;
  cfg.wgrad_dtype = c.wgrad;
  return cfg;
}

// W13 rows of every expert between the model's blocked order (gate rows [0, F), up rows [F, 2F))
// and `layout` (interleaved: gate f at 2f, up f at 2f + 1): to the layout, or back (to_blocked).
template <typename T>
std::vector<T> permute_w13(const std::vector<T>& in, int F, int D, W13Layout layout, bool to_blocked) {
  if (layout == W13Layout::gate_up_blocked) return in;
  std::vector<T> out(in.size());
  const size_t per_expert = size_t(2) * F * D;
  for (size_t e = 0; e < in.size() / per_expert; ++e)
    for (int f = 0; f < F; ++f)
      for (int half = 0; half < 2; ++half) {
        const size_t blocked_row = size_t(half) * F + f, interleaved_row = size_t(2) * f + half;
        std::copy_n(in.begin() + e * per_expert + (to_blocked ? interleaved_row : blocked_row) * D, D,
                    out.begin() + e * per_expert + (to_blocked ? blocked_row : interleaved_row) * D);
      }
  return out;
}
template <typename T>
std::vector<T> w13_to_layout(const std::vector<T>& blocked, int F, int D, W13Layout layout) {
  return permute_w13(blocked, F, D, layout, /*to_blocked=*/false);
}
template <typename T>
std::vector<T> w13_to_blocked(const std::vector<T>& laid_out, int F, int D, W13Layout layout) {
  return permute_w13(laid_out, F, D, layout, /*to_blocked=*/true);
}

struct DeviceArray {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceArray() = default;
  explicit DeviceArray(size_t n) : bytes(n) {
    if (cudaMalloc(&ptr, n) != cudaSuccess) throw std::runtime_error("cudaMalloc failed in test");
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  template <typename T>
  void upload(const std::vector<T>& v) {
    if (cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("upload failed");
  }
  template <typename T>
  std::vector<T> download(size_t n) const {
    std::vector<T> v(n);
    if (cudaMemcpy(v.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess)
      throw std::runtime_error("download failed");
    return v;
  }
  void fill_bytes(int byte) {
    if (cudaMemset(ptr, byte, bytes) != cudaSuccess) throw std::runtime_error("memset failed");
  }
};

struct RankDevice {
  std::unique_ptr<DeviceArray> x, ids, scores, w13, w2, out, grad_out, grad_x, grad_scores, grad_w13, grad_w2;
  std::unique_ptr<DeviceArray> clip_counts;  // int64 [E_local][2], requested by every forward
};

using PipelineFactory = std::function<std::unique_ptr<StagedPipeline>(const Config&)>;

class EpWorld {
 public:
  // Virtual ranks by default; `make` builds the pipeline over another transport (c.R must then
  // equal its launch ranks).
  EpWorld(const LayerCase& c, uint64_t seed, uint64_t timeout_ns = 2'000'000'000ull, PipelineFactory make = {})
      : c_(c), rng_(seed), shape_{c.R, c.T, c.D, c.F, c.E, c.K, c.activation, 1.702, c.swiglu_limit} {
    config_ = make_config(c);
    PipelineOptions options;
    options.timeout_ns = timeout_ns;
    pipeline_ = make ? make(config_) : StagedPipeline::create_virtual(config_, c.R, options);
    const int EL = c.E / c.R;
    const size_t TD = size_t(c.T) * c.D, TK = size_t(c.T) * c.K;
    const size_t w13n = size_t(EL) * 2 * c.F * c.D, w2n = size_t(EL) * c.D * c.F;
    host_.resize(c.R);
    dev_.resize(c.R);
    for (int r = 0; r < c.R; ++r) {
      RankData& h = host_[r];
      h.x_TD = random_bf16(TD, 1.0f, rng_);
      h.w13_E2FD = random_bf16(w13n, 3.0f / std::sqrt(float(c.D)), rng_);
      h.w2_EDF = random_bf16(w2n, 3.0f / std::sqrt(float(c.F)), rng_);
      h.grad_out_TD = random_bf16(TD, 1.0f, rng_);
      RankDevice& d = dev_[r];
      d.x = std::make_unique<DeviceArray>(TD * 2);
      d.ids = std::make_unique<DeviceArray>(TK * 4);
      d.scores = std::make_unique<DeviceArray>(TK * 4);
      d.w13 = std::make_unique<DeviceArray>(w13n * 2);
      d.w2 = std::make_unique<DeviceArray>(w2n * 2);
      d.out = std::make_unique<DeviceArray>(TD * 2);
      d.grad_out = std::make_unique<DeviceArray>(TD * 2);
      d.grad_x = std::make_unique<DeviceArray>(TD * 2);
      d.grad_scores = std::make_unique<DeviceArray>(TK * 4);
      d.grad_w13 = std::make_unique<DeviceArray>(w13n * grad_bytes());
      d.grad_w2 = std::make_unique<DeviceArray>(w2n * grad_bytes());
      d.clip_counts = std::make_unique<DeviceArray>(size_t(EL) * 2 * sizeof(int64_t));
      d.x->upload(h.x_TD);
      d.w13->upload(w13_to_layout(h.w13_E2FD, c.F, c.D, c.layout));
      d.w2->upload(h.w2_EDF);
      d.grad_out->upload(h.grad_out_TD);
    }
    new_routing(c.routing);
  }

  // Fresh ids and scores (same buffers: a captured graph sees the new routing).
  void new_routing(Routing routing) {
    std::uniform_real_distribution<float> score_dist(0.1f, 1.0f);
    for (int r = 0; r < c_.R; ++r) {
      RankData& h = host_[r];
      h.ids_TK = make_ids(routing, c_.T, c_.K, c_.E, c_.R, rng_);
      h.scores_TK.resize(h.ids_TK.size());
      std::vector<uint16_t> scores_bf16(h.ids_TK.size());
      for (size_t i = 0; i < h.scores_TK.size(); ++i) {
        scores_bf16[i] = to_bf16(score_dist(rng_));
        h.scores_TK[i] = c_.scores == DType::bf16 ? from_bf16(scores_bf16[i]) : score_dist(rng_);
      }
      dev_[r].ids->upload(h.ids_TK);
      if (c_.scores == DType::bf16) dev_[r].scores->upload(scores_bf16);
      else dev_[r].scores->upload(h.scores_TK);
    }
  }

  // NaN in every output; random values in the weight grads when accumulating (kept for the check).
  void poison_outputs() {
    for (int r = 0; r < c_.R; ++r) {
      RankDevice& d = dev_[r];
      d.out->fill_bytes(0xff);  // 0xffff: a bf16 NaN
      d.clip_counts->fill_bytes(0xff);  // -1: a count the forward never wrote
      d.grad_x->fill_bytes(0xff);
      d.grad_scores->fill_bytes(0xff);  // NaN as fp32 and as bf16
      if (c_.accumulate) {
        std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
        prior_w13_.resize(c_.R);
        prior_w2_.resize(c_.R);
        prior_w13_[r].resize(d.grad_w13->bytes / grad_bytes());
        prior_w2_[r].resize(d.grad_w2->bytes / grad_bytes());
        // bf16 gradients: priors drawn as bf16 values, so the model adds exactly what the GPU holds
        for (auto& v : prior_w13_[r]) v = c_.wgrad == DType::bf16 ? from_bf16(to_bf16(dist(rng_))) : dist(rng_);
        for (auto& v : prior_w2_[r]) v = c_.wgrad == DType::bf16 ? from_bf16(to_bf16(dist(rng_))) : dist(rng_);
        upload_grad(*d.grad_w13, w13_to_layout(prior_w13_[r], c_.F, c_.D, c_.layout));
        upload_grad(*d.grad_w2, prior_w2_[r]);
      } else {
        d.grad_w13->fill_bytes(0xff);
        d.grad_w2->fill_bytes(0xff);
      }
    }
  }

  std::vector<ForwardArgs> forward_args() const {
    std::vector<ForwardArgs> args(c_.R);
    for (int r = 0; r < c_.R; ++r) {
      const RankDevice& d = dev_[r];
      args[r].x_TD = d.x->ptr;
      args[r].ids_TK = static_cast<const int32_t*>(d.ids->ptr);
      args[r].scores_TK = d.scores->ptr;
      args[r].scores_dtype = c_.scores;
      args[r].w13 = d.w13->ptr;
      args[r].w13_layout = c_.layout;
      args[r].w2 = d.w2->ptr;
      args[r].out_TD = d.out->ptr;
      args[r].clip_counts_E2 = static_cast<int64_t*>(d.clip_counts->ptr);
    }
    return args;
  }

  std::vector<BackwardArgs> backward_args() const {
    const std::vector<ForwardArgs> fwd = forward_args();
    std::vector<BackwardArgs> args(c_.R);
    for (int r = 0; r < c_.R; ++r) {
      const RankDevice& d = dev_[r];
      args[r].forward = fwd[r];
      args[r].forward.out_TD = nullptr;  // backward must not need the forward's output
      args[r].grad_out_TD = d.grad_out->ptr;
      args[r].grad_x_TD = d.grad_x->ptr;
      args[r].grad_scores_TK = d.grad_scores->ptr;
      args[r].grad_w13 = d.grad_w13->ptr;
      args[r].grad_w2 = d.grad_w2->ptr;
      args[r].accumulate_wgrad = c_.accumulate;
    }
    return args;
  }

  void forward(cudaStream_t stream) { pipeline_->forward(forward_args(), stream); }
  void backward(cudaStream_t stream) { pipeline_->backward(backward_args(), stream); }

  std::vector<double> scores_as_double(const DeviceArray& a) const {
    const size_t n = size_t(c_.T) * c_.K;
    std::vector<double> v(n);
    if (c_.scores == DType::bf16) {
      auto raw = a.download<uint16_t>(n);
      for (size_t i = 0; i < n; ++i) v[i] = from_bf16(raw[i]);
    } else {
      auto raw = a.download<float>(n);
      for (size_t i = 0; i < n; ++i) v[i] = raw[i];
    }
    return v;
  }

  // Rank r's weight gradients as values, W13 rows in the model's (blocked) order.
  std::vector<float> grad_w13(int r) const {
    return w13_to_blocked(download_grad(*dev_[r].grad_w13), c_.F, c_.D, c_.layout);
  }
  std::vector<float> grad_w2(int r) const { return download_grad(*dev_[r].grad_w2); }

  const LayerCase& c() const { return c_; }
  const ModelShape& shape() const { return shape_; }
  const std::vector<RankData>& host() const { return host_; }
  std::vector<RankData>& host() { return host_; }
  std::vector<RankDevice>& dev() { return dev_; }
  const std::vector<RankDevice>& dev() const { return dev_; }
  StagedPipeline& pipeline() { return *pipeline_; }
  const std::vector<std::vector<float>>& prior_w13() const { return prior_w13_; }
  const std::vector<std::vector<float>>& prior_w2() const { return prior_w2_; }

 private:
  size_t grad_bytes() const { return c_.wgrad == DType::bf16 ? 2 : 4; }
  void upload_grad(DeviceArray& a, const std::vector<float>& values) const {
    if (c_.wgrad == DType::fp32) return a.upload(values);
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) bits[i] = to_bf16(values[i]);
    a.upload(bits);
  }
  std::vector<float> download_grad(const DeviceArray& a) const {
    const size_t n = a.bytes / grad_bytes();
    if (c_.wgrad == DType::fp32) return a.download<float>(n);
    const auto bits = a.download<uint16_t>(n);
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = from_bf16(bits[i]);
    return v;
  }

  LayerCase c_;
  std::mt19937_64 rng_;
  ModelShape shape_;
  Config config_;
  std::unique_ptr<StagedPipeline> pipeline_;
  std::vector<RankData> host_;
  std::vector<RankDevice> dev_;
  std::vector<std::vector<float>> prior_w13_, prior_w2_;
};

// One forward and one backward pass on poisoned outputs, the pipeline's error state checked after
// each (wrap in ASSERT_NO_FATAL_FAILURE to stop the test at a failed check).
inline void run_pass(EpWorld& w, cudaStream_t stream) {
  w.poison_outputs();
  w.forward(stream);
  ASSERT_NO_THROW(w.pipeline().check(stream));
  w.backward(stream);
  ASSERT_NO_THROW(w.pipeline().check(stream));
}

// Rank r's clip counts against the model: exact for plain SwiGLU (zeros), else within 1% + 2
// (the GPU rounds h13 to bf16 from fp32 sums in another order: values at the limit may fall
// either side).
inline void check_clip_counts(const EpWorld& w, const std::vector<ModelOut>& model, int r) {
  const int EL = w.c().E / w.c().R;
  const auto got = w.dev()[r].clip_counts->download<int64_t>(size_t(EL) * 2);
  for (int i = 0; i < 2 * EL; ++i) {
    const int64_t want = model[r].clip_counts_E2[i];
    if (w.c().activation == Activation::swiglu) EXPECT_EQ(got[i], 0) << "clip count " << i;
    else EXPECT_LE(std::llabs(got[i] - want), want / 100 + 2) << "clip count expert " << i / 2 << " column " << i % 2;
  }
}

// Rank r's weight gradients against the model (plus the priors when accumulating): within
// kTolerance as a whole and kRowTolerance per expert; an expert nobody chose has exactly zero
// gradients (overwrite mode), not stale values, not NaN.
inline void check_weight_grads(const EpWorld& w, const std::vector<ModelOut>& model, int r) {
  const LayerCase& c = w.c();
  const int EL = c.E / c.R;
  const auto gw13 = w.grad_w13(r), gw2 = w.grad_w2(r);
  std::vector<double> want13 = model[r].grad_w13_E2FD, want2 = model[r].grad_w2_EDF;
  if (c.accumulate) {
    for (size_t i = 0; i < want13.size(); ++i) want13[i] += w.prior_w13()[r][i];
    for (size_t i = 0; i < want2.size(); ++i) want2[i] += w.prior_w2()[r][i];
  }
  const std::vector<double>& slack13 = model[r].grad_w13_clamp_slack_E;  // clamp flips (ModelOut)
  double slack13_total = 0;
  for (double s : slack13) slack13_total += s;
  EXPECT_LT(relative_error_beyond(gw13, want13, slack13_total), kTolerance) << "grad_w13";
  EXPECT_LT(relative_error(gw2, want2), kTolerance) << "grad_w2";
  const size_t per13 = want13.size() / EL, per2 = want2.size() / EL;
  for (int j = 0; j < EL; ++j) {
    if (model[r].rows_per_local_expert[j] == 0 && !c.accumulate) {
      bool all_zero = true;
      for (size_t i = j * per13; i < (j + 1) * per13; ++i) all_zero &= gw13[i] == 0.0f;
      for (size_t i = j * per2; i < (j + 1) * per2; ++i) all_zero &= gw2[i] == 0.0f;
      EXPECT_TRUE(all_zero) << "expert " << j << " received no rows but has nonzero gradients";
    } else {
      EXPECT_LT(relative_error_beyond(gw13, want13, slack13[j], j * per13, (j + 1) * per13), kRowTolerance)
          << "grad_w13 expert " << j << " (beyond its clamp slack " << slack13[j] << ")";
      EXPECT_LT(relative_error(gw2, want2, j * per2, (j + 1) * per2), kRowTolerance) << "grad_w2 expert " << j;
    }
  }
}

using poise::testing::fresh_seed;
using poise::testing::have_sm90_gpu;

}  // namespace poise::ep::testing
