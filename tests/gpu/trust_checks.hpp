// What the trust tests share: raising and non-raising expectations on DeviceError.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_support.hpp"
#include "poise/poise.hpp"
#include "poise/reference.hpp"
#include "testing/device_layer.hpp"
#include "testing/layer_config.hpp"

namespace poise::trust_test {

using testing::expect_all_nan;
using testing::layer_config;
using testing::ReferenceLayer;
using testing::TestStream;
using testing::zero_outputs;

constexpr double kTolerance = 1e-2;

// ---- small tools ---------------------------------------------------------------------------------

inline void synchronize(cudaStream_t stream) { ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess); }

// Per rank: every element 0, what zero_outputs left (the call that should have written nothing).
inline void expect_all_zero(const std::vector<std::vector<float>>& per_rank, const std::string& what) {
  for (size_t r = 0; r < per_rank.size(); ++r) {
    const auto nonzero = std::count_if(per_rank[r].begin(), per_rank[r].end(), [](float x) { return x != 0.0f; });
    EXPECT_EQ(nonzero, 0) << what << ", rank " << r << ": written by a call that should have launched nothing";
  }
}

// `call` must raise DeviceError whose message holds every piece (pieces[0], the root cause, before
// any peer's "stopped", and no timeout: a fault stops the peers at once). Returns whether it raised.
inline bool expect_device_error(const std::function<void()>& call, const std::vector<std::string>& pieces,
                         const std::string& what) {
  try {
    call();
  } catch (const DeviceError& e) {
    const std::string msg = e.what();
    for (const std::string& piece : pieces) EXPECT_NE(msg.find(piece), std::string::npos) << what << ": " << msg;
    EXPECT_EQ(msg.find("timed out"), std::string::npos) << what << ": " << msg;
    if (msg.find("stopped:") != std::string::npos)  // root causes first, their echoes after
      EXPECT_LT(msg.find(pieces[0]), msg.find("stopped:")) << what << ": " << msg;
    return true;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": raised a non-DeviceError: " << e.what();
    return true;
  }
  ADD_FAILURE() << what << ": did not raise";
  return false;
}

// Like expect_device_error, but a call that does not raise is fine too (it was enqueued before the
// fault was visible). Returns whether it ran.
inline bool runs_or_raises(const std::function<void()>& call, const std::vector<std::string>& pieces,
                    const std::string& what) {
  try {
    call();
    return true;
  } catch (const DeviceError& e) {
    const std::string msg = e.what();
    for (const std::string& piece : pieces) EXPECT_NE(msg.find(piece), std::string::npos) << what << ": " << msg;
    return false;
  }
}


}  // namespace poise::trust_test
