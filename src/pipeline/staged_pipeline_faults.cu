// StagedPipeline's device faults: the host-mapped fault records, check() and raise_if_faulted()
// (root causes first), and reset().
#include "pipeline/staged_pipeline.hpp"

#include <algorithm>
#include <new>
#include <string>
#include <vector>

#include "gemm/sm90/expert_mlp.hpp"
#include "poise/errors.hpp"
#include "runtime/cuda_check.hpp"

namespace poise::ep {

using runtime::cuda_check;

// Host-mapped, so the host reads a fault without synchronizing the stream (raise_if_faulted).
void StagedPipeline::allocate_fault_records() {
  const size_t bytes = sizeof(FaultRecord) * static_cast<size_t>(launch_.launch_ranks);
  void* host = nullptr;
  cuda_check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc(fault records)");
  fault_records_ = static_cast<FaultRecord*>(host);
  for (int s = 0; s < launch_.launch_ranks; ++s) new (&fault_records_[s]) FaultRecord();
  void* device = nullptr;
  cuda_check(cudaHostGetDevicePointer(&device, host, 0), "cudaHostGetDevicePointer(fault records)");
  launch_.fault_records = static_cast<FaultRecord*>(device);
}

void StagedPipeline::check(cudaStream_t stream) {
  cuda_check(cudaStreamSynchronize(stream), "EP pipeline: cudaStreamSynchronize");
  std::vector<comm::ErrorWord> faults;
  for (const comm::ErrorWord& e : transport_->read_errors()) {
    if (e.code != 0) faults.push_back(e);
  }
  // A grouped-GEMM pipeline wait past its bound (the launch drained instead of hanging).
  std::string gemm_fault;
  for (int s = 0; s < launch_.launch_ranks && gemm_fault.empty(); ++s) {
    const sm90::PipelineFault f = sm90::read_pipeline_fault({launch_.scratch.rank[s].gemm_fault_word}, stream);
    if (f.occurred) gemm_fault = "SM90 expert GEMM: " + sm90::describe(f) + " (launch slot " + std::to_string(s) + ")";
  }
  if (faults.empty() && gemm_fault.empty()) return;
  std::string message = "EP device error: " + describe_faults(faults);
  if (!gemm_fault.empty()) message += (faults.empty() ? "" : "; ") + gemm_fault;
  throw DeviceError(message + " (call reset() before the next call)");
}

std::vector<comm::ErrorWord> StagedPipeline::recorded_faults() const {
  std::vector<comm::ErrorWord> faults;
  for (int s = 0; s < launch_.launch_ranks; ++s) {
    const volatile FaultRecord& r = fault_records_[s];
    if (r.error.code == 0) continue;
    comm::ErrorWord e;
    e.code = r.error.code;
    e.phase = r.error.phase;
    e.rank = r.error.rank;
    e.peer = r.error.peer;
    e.value = r.error.value;
    e.token = r.error.token;
    faults.push_back(e);
  }
  return faults;
}

void StagedPipeline::raise_if_faulted() const {
  std::vector<comm::ErrorWord> faults = recorded_faults();
  if (faults.empty()) return;
  throw DeviceError("an earlier call faulted on the device: " + describe_faults(faults) +
                    "; its outputs were filled with NaN, and every call fails until reset()");
}

std::string StagedPipeline::describe_faults(std::vector<comm::ErrorWord> faults) const {
  // Root causes first: a timeout or a stop is usually the echo of another rank's failure.
  auto echo = [](const comm::ErrorWord& e) {
    return e.code == static_cast<int32_t>(comm::ErrorCode::timeout) ||
           e.code == static_cast<int32_t>(comm::ErrorCode::peer_failed);
  };
  std::stable_sort(faults.begin(), faults.end(),
                   [&](const comm::ErrorWord& a, const comm::ErrorWord& b) { return !echo(a) && echo(b); });
  std::string message;
  for (const comm::ErrorWord& e : faults) {
    message += (message.empty() ? "" : "; ") + comm::describe(e, transport_->timeout_ns());
    if (e.code == static_cast<int32_t>(comm::ErrorCode::expert_gemm_fault))
      message += ": " + sm90::describe(sm90::unpack_pipeline_fault(static_cast<unsigned long long>(e.value)));
  }
  return message;
}

void StagedPipeline::reset() {
  cuda_check(cudaDeviceSynchronize(), "reset: cudaDeviceSynchronize");
  transport_->reset();
  for (int s = 0; s < launch_.launch_ranks; ++s) {
    cuda_check(cudaMemset(launch_.scratch.rank[s].gemm_fault_word, 0, sizeof(unsigned long long)), "reset: GEMM fault word");
    fault_records_[s] = FaultRecord();
  }
}

}  // namespace poise::ep
