// What the expert-MLP kernel tests share: float64 references, random grouped rows, comparisons,
// the per-case fixture and the inputs of the row-writing GEMMs.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <cuda_runtime_api.h>

#include "runtime/device_info.hpp"
#include "gemm/sm90/expert_mlp.hpp"
#include "poise/errors.hpp"
#include "expert_mlp_test_support.hpp"

namespace poise::test {

using sm90::ExpertMlpShape;
using sm90::GroupedRows;

constexpr double kBf16Tolerance = 1e-2;  // bf16 outputs: rounding alone gives ~3e-3
constexpr double kFp32Tolerance = 1e-4;  // fp32 outputs from bf16 operands, fp32 accumulation

inline bool have_sm90() { return cuda_device_count() > 0 && is_sm90_device(0); }

// What the host-validation tests hand the entry points, which must refuse before touching the
// device: an address nothing reads (kFakeAddress), 4 experts' grouped rows there, D = 256, F = 128.
inline int32_t* const kFakeAddress = reinterpret_cast<int32_t*>(0x1000);
inline GroupedRows fake_grouped_rows() {
  GroupedRows rows{kFakeAddress, kFakeAddress, 4, 1024};
  rows.faults.word = reinterpret_cast<unsigned long long*>(kFakeAddress);
  return rows;
}
inline ExpertMlpShape validation_shape() {
  ExpertMlpShape shape;
  shape.hidden_dim = 256;
  shape.intermediate_dim = 128;
  return shape;
}

inline std::vector<double> to_double(const std::vector<uint16_t>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = from_bf16(v[i]);
  return d;
}

// out[r][n] = sum_k A[r][k] * W_e(n, k) over valid rows. W is [E][N][K] (nk) or [E][K][N] (kn).
inline std::vector<double> ref_rows_gemm(const RowLayout& l, const std::vector<double>& A, int64_t K,
                                  const std::vector<double>& W, int64_t N, bool w_is_nk) {
  std::vector<double> out(l.rows * N, 0.0);
  parallel_for(l.rows, [&](int64_t r) {
    for (size_t e = 0; e < l.counts.size(); ++e) {
      if (r < l.offsets[e] || r >= l.offsets[e] + l.counts[e]) continue;
      const double* w = W.data() + e * N * K;
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += A[r * K + k] * (w_is_nk ? w[n * K + k] : w[k * N + n]);
        out[r * N + n] = s;
      }
    }
  });
  return out;
}

// out[e][m][n] = sum over expert e's rows of A[r][m] * B[r][n].
inline std::vector<double> ref_wgrad(const RowLayout& l, const std::vector<double>& A, int64_t M,
                              const std::vector<double>& B, int64_t N) {
  const int64_t E = l.counts.size();
  std::vector<double> out(E * M * N, 0.0);
  parallel_for(E * M, [&](int64_t em) {
    const int64_t e = em / M, m = em % M;
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t r = l.offsets[e]; r < l.offsets[e] + l.counts[e]; ++r) s += A[r * M + m] * B[r * N + n];
      out[em * N + n] = s;
    }
  });
  return out;
}

// Random bf16 rows [R][cols] (normal, stddev), the rows no expert owns poisoned.
inline std::vector<uint16_t> random_rows(Rng& rng, const RowLayout& l, int64_t cols, float stddev) {
  auto v = rng.bf16_normal(l.rows * cols, stddev);
  poison_padding_rows(v, l, cols);
  return v;
}

// The routing score's gradient per row from DGRAD W2's per-tile pieces, summed in piece order
// (as every consumer must, for the same bits on every run).
inline std::vector<float> sum_score_partials(const std::vector<float>& partials_RP, int64_t P) {
  std::vector<float> out(partials_RP.size() / P, 0.0f);
  for (size_t r = 0; r < out.size(); ++r)
    for (int64_t p = 0; p < P; ++p) out[r] += partials_RP[r * P + p];
  return out;
}

// Index of gate / up of activation column f inside a [2F] row, per W13 layout.
inline int64_t gate_col(int64_t f, int64_t F, W13Layout lay) { return lay == W13Layout::gate_up_blocked ? f : 2 * f; }
inline int64_t up_col(int64_t f, int64_t F, W13Layout lay) { return lay == W13Layout::gate_up_blocked ? F + f : 2 * f + 1; }

// Compares a bf16 [R][C] grouped-rows output: valid rows against ref, other rows must keep poison.
inline Comparison compare_rows_bf16(const std::vector<uint16_t>& out, const std::vector<double>& ref,
                             const RowLayout& l, int64_t C) {
  ErrorAccumulator acc;
  for (int64_t r = 0; r < l.rows; ++r) {
    const bool valid = l.is_row_valid(r);
    for (int64_t c = 0; c < C; ++c) {
      if (valid) acc.add(from_bf16(out[r * C + c]), ref[r * C + c]);
      else if (out[r * C + c] != kBf16Poison) ++acc.c.poison_lost;
    }
  }
  return acc.finish();
}

template <class T>
inline Comparison compare_all(const std::vector<T>& out, const std::vector<double>& ref) {
  ErrorAccumulator acc;
  for (size_t i = 0; i < out.size(); ++i) {
    if constexpr (std::is_same_v<T, uint16_t>) acc.add(from_bf16(out[i]), ref[i]);
    else acc.add(out[i], ref[i]);
  }
  return acc.finish();
}

inline void expect_close(const Comparison& c, double tol, const char* what) {
  EXPECT_GT(c.compared, -1) << what;
  EXPECT_EQ(c.non_finite, 0) << what << ": " << c.describe();
  EXPECT_EQ(c.poison_lost, 0) << what << ": " << c.describe();
  EXPECT_LT(c.rel_error, tol) << what << ": " << c.describe();
}

// Slices [first, end) of per-expert blocks of `per_expert` values.
template <class T>
std::vector<T> slice_experts(const std::vector<T>& m, int64_t per_expert, int64_t first, int64_t end) {
  return std::vector<T>(m.begin() + first * per_expert, m.begin() + end * per_expert);
}

// The bits of two buffers equal (NaN poison included, which == on floats would not accept).
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// fn(expert, row) for every valid row of every expert.
template <class Fn>
void for_each_row(const RowLayout& l, Fn fn) {
  for (size_t e = 0; e < l.counts.size(); ++e)
    for (int64_t r = l.offsets[e]; r < l.offsets[e] + l.counts[e]; ++r) fn(int64_t(e), r);
}

// DGRAD W2's float64 expectations over the valid rows, from grad_a0 = grad_y . W2[e] [R][F] (before
// the score) and the saved bf16 h13 [R][2F] (gate / up columns per layout): grad_h13 =
// act_backward(h13, score * grad_a0), a = score * act(h13), the routing score's gradient
// sum_f grad_a0 * act(h13), and per row the L2 norm of that sum's terms (the scale of its rounding).
// scores null: score 1.
struct DgradW2Ref {
  std::vector<double> grad_h13, a, grad_scores, grad_score_terms;
};
inline DgradW2Ref ref_dgrad_w2(const RowLayout& l, const std::vector<double>& grad_a0,
                               const std::vector<uint16_t>& h13, const float* scores, int64_t F, W13Layout layout,
                               const Act& act) {
  DgradW2Ref ref{std::vector<double>(l.rows * 2 * F, 0.0), std::vector<double>(l.rows * F, 0.0),
                 std::vector<double>(l.rows, 0.0), std::vector<double>(l.rows, 0.0)};
  for_each_row(l, [&](int64_t, int64_t r) {
    const double score = scores ? scores[r] : 1.0;
    double terms2 = 0;
    for (int64_t f = 0; f < F; ++f) {
      const int64_t gc = gate_col(f, F, layout), uc = up_col(f, F, layout);
      const double g = from_bf16(h13[r * 2 * F + gc]), u = from_bf16(h13[r * 2 * F + uc]);
      const double a = act_forward(g, u, act), ga0 = grad_a0[r * F + f];
      act_backward(g, u, score * ga0, act, ref.grad_h13[r * 2 * F + gc], ref.grad_h13[r * 2 * F + uc]);
      ref.a[r * F + f] = score * a;
      ref.grad_scores[r] += ga0 * a;
      terms2 += (ga0 * a) * (ga0 * a);
    }
    ref.grad_score_terms[r] = std::sqrt(terms2);
  });
  return ref;
}

// Rows scattered to slots (sm90::RowScatter, the EP pipeline's direct combine): every valid row's
// bytes land in its slot of its owner's buffer, bit for bit the grouped row the plain store writes;
// slots no row names keep their poison. Two owners of S slots each, 256 guard bytes before slot 0
// (slot_offset); valid rows take a random slot each (an injective draw), padding rows name none.
// bad_rows: valid rows given an origin outside the owners' slots, which must be stored nowhere.
inline void check_row_scatter(const RowLayout& l, int64_t D, uint64_t seed, const std::vector<uint16_t>& grouped,
                       const std::function<void(const sm90::RowScatter&)>& run, const char* what,
                       const std::vector<int64_t>& bad_rows = {}) {
  const int64_t R = l.rows, owners = 2, guard = 256 / 2;  // guard in bf16 elements
  int64_t valid_rows = 0;
  for (int32_t c : l.counts) valid_rows += c;
  const int64_t S = std::max<int64_t>(1, (valid_rows + 1) / 2 + 3);  // slots per owner, some left free
  std::vector<int32_t> slots(owners * S);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937_64(seed));
  std::vector<int32_t> origin(R, -1);
  int64_t next = 0;
  for (int64_t r = 0; r < R; ++r)
    if (l.is_row_valid(r)) origin[r] = slots[next++];
  for (size_t i = 0; i < bad_rows.size(); ++i) origin[bad_rows[i]] = i % 2 ? -5 : static_cast<int32_t>(owners * S);
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> owner_rows;
  std::vector<char*> bases;
  for (int64_t o = 0; o < owners; ++o) {
    owner_rows.push_back(std::make_unique<DeviceBuffer<uint16_t>>(std::vector<uint16_t>(guard + S * D, kBf16Poison)));
    bases.push_back(reinterpret_cast<char*>(owner_rows.back()->ptr));
  }
  DeviceBuffer<char*> dbases(bases);
  DeviceBuffer<int32_t> dorigin(origin);
  run({dorigin.ptr, dbases.ptr, guard * 2, S, owners});
  cuda_ok(cudaDeviceSynchronize(), what);
  std::vector<int64_t> row_of_slot(owners * S, -1);
  for (int64_t r = 0; r < R; ++r)
    if (l.is_row_valid(r) && std::find(bad_rows.begin(), bad_rows.end(), r) == bad_rows.end())
      row_of_slot[origin[r]] = r;
  int64_t wrong = 0, poison_lost = 0;
  for (int64_t o = 0; o < owners; ++o) {
    const auto got = owner_rows[o]->download();
    for (int64_t i = 0; i < guard; ++i) poison_lost += got[i] != kBf16Poison;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t r = row_of_slot[o * S + s];
      for (int64_t d = 0; d < D; ++d) {
        const uint16_t v = got[guard + s * D + d];
        if (r < 0) poison_lost += v != kBf16Poison;
        else wrong += v != grouped[r * D + d];
      }
    }
  }
  EXPECT_EQ(wrong, 0) << what << ": elements that differ from the grouped rows";
  EXPECT_EQ(poison_lost, 0) << what << ": elements written outside the named slots";
}

struct Case {
  const char* name;
  std::vector<int32_t> counts;
  int64_t D, F;
  W13Layout layout;
  bool clamped;
  uint64_t seed;
};

// Everything one case needs on the device: layout, weights and per-kernel random inputs.
struct Fixture {
  Case cs;
  RowLayout l;
  Act act;
  ExpertMlpShape shape;
  DeviceBuffer<int32_t> offsets, counts;
  DeviceBuffer<int32_t> tile_counters{std::vector<int32_t>{0, 0}};  // the dynamic tile order, as a Context runs it
  DeviceBuffer<unsigned long long> fault_word{std::vector<unsigned long long>{0}};
  GroupedRows rows;

  explicit Fixture(const Case& c) : cs(c), l(make_layout(c.counts)), offsets(l.offsets), counts(l.counts) {
    act.clamped = c.clamped;
    act.limit = c.clamped ? 1.5 : 7.0;  // small limit: the clamps are exercised
    shape.hidden_dim = c.D;
    shape.intermediate_dim = c.F;
    shape.activation = c.clamped ? Activation::swiglu_clamped : Activation::swiglu;
    shape.swiglu_alpha = static_cast<float>(act.alpha);
    shape.swiglu_limit = static_cast<float>(act.limit);
    shape.w13_layout = c.layout;
    rows.row_offsets_E = offsets.ptr;
    rows.row_counts_E = counts.ptr;
    rows.num_experts = static_cast<int64_t>(c.counts.size());
    rows.max_rows = l.rows;
    rows.tile_counters = tile_counters.ptr;
    rows.faults.word = fault_word.ptr;
  }
  sm90::PipelineFault take_fault() const { return sm90::take_pipeline_fault(rows.faults, nullptr); }
  int64_t E() const { return static_cast<int64_t>(cs.counts.size()); }
};

// The random inputs of the two GEMMs that write rows of D, drawn in a fixed order for a seed: host
// copies for the float64 references, device copies for the kernels.
struct FpropW2Inputs {  // a_RF, W2, scores_R
  std::vector<uint16_t> a, w2;
  std::vector<float> scores;
  DeviceBuffer<uint16_t> da, dw2;
  DeviceBuffer<float> ds;
  FpropW2Inputs(const Fixture& fx, Rng& rng)
      : a(random_rows(rng, fx.l, fx.cs.F, 1.0f)),
        w2(rng.bf16_normal(fx.E() * fx.cs.D * fx.cs.F, 1.0f / std::sqrt(float(fx.cs.F)))),
        scores(rng.uniform(fx.l.rows, 0.1f, 1.0f)), da(a), dw2(w2), ds(scores) {}
};
struct DgradW13Inputs {  // grad_h13_R2F, W13
  std::vector<uint16_t> gh, w13;
  DeviceBuffer<uint16_t> dgh, dw13;
  DgradW13Inputs(const Fixture& fx, Rng& rng)
      : gh(random_rows(rng, fx.l, 2 * fx.cs.F, 1.0f)),
        w13(rng.bf16_normal(fx.E() * 2 * fx.cs.F * fx.cs.D, 1.0f / std::sqrt(float(2 * fx.cs.F)))),
        dgh(gh), dw13(w13) {}
};

}  // namespace poise::test
