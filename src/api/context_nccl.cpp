// Context::create_from_nccl (poise/nccl.hpp): the staged pipeline over an NcclTransport, installed
// into a Context through ContextAccess, so the poise library itself never links NCCL.
#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "runtime/current_device.hpp"
#include "comm/nccl_check.hpp"
#include "comm/nccl_transport.hpp"
#include "runtime/device_info.hpp"
#include "api/context_internal.hpp"
#include "poise/errors.hpp"
#include "poise/nccl.hpp"

namespace poise {
namespace {

using comm::nccl_check;

std::string version_string(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
}

// The Config fields every rank must share, as numbers (doubles are exact for every value they hold).
std::vector<std::pair<const char*, double>> shared_fields(const Config& c) {
  return {{"num_local_input_tokens", double(c.num_local_input_tokens)},
          {"hidden_dim", double(c.hidden_dim)},
          {"intermediate_dim", double(c.intermediate_dim)},
          {"top_k", double(c.top_k)},
          {"num_experts", double(c.num_experts)},
          {"activation", double(c.activation)},
          {"swiglu_alpha", c.swiglu_alpha},
          {"swiglu_limit", c.swiglu_limit},
          {"balance", double(c.balance)},
          {"balance_tolerance", c.balance_tolerance},
          {"receive_capacity_factor", c.receive_capacity_factor},
          {"num_activation_slots", double(c.num_activation_slots)},
          {"max_moe_layers_per_activation_slot", double(c.max_moe_layers_per_activation_slot)},
          {"activation_slot_capacity_factor", c.activation_slot_capacity_factor.value_or(-1.0)},
          {"activation_slot_bytes", double(c.activation_slot_bytes.value_or(-1))},
          {"wgrad_dtype", double(c.wgrad_dtype)},
          {"inference", double(c.inference)}};
}

// Every rank must create its context with the same Config (the kernels size buffers and exchange
// rows by it): gathered once here, a field that differs is named before anything is allocated for
// the layer, instead of corrupting the first call.
void require_same_config_on_every_rank(const Config& config, ncclComm* comm, int ep_size, int rank) {
  const auto fields = shared_fields(config);
  const size_t n = fields.size();
  std::vector<double> mine(n), all(n * static_cast<size_t>(ep_size));
  for (size_t i = 0; i < n; ++i) mine[i] = fields[i].second;
  double* device = nullptr;
  cudaStream_t stream = nullptr;
  auto fail = [&](const std::string& what) {
    if (device) cudaFree(device);
    if (stream) cudaStreamDestroy(stream);
    throw DeviceError("create_from_nccl: " + what);
  };
  if (cudaMalloc(&device, sizeof(double) * all.size()) != cudaSuccess) fail("cudaMalloc(config check)");
  if (cudaStreamCreate(&stream) != cudaSuccess) fail("cudaStreamCreate(config check)");
  if (cudaMemcpy(device + n * rank, mine.data(), sizeof(double) * n, cudaMemcpyHostToDevice) != cudaSuccess)
    fail("cudaMemcpy(config check)");
  if (ncclAllGather(device + n * rank, device, n, ncclFloat64, comm, stream) != ncclSuccess)
    fail("ncclAllGather(config check)");
  if (cudaStreamSynchronize(stream) != cudaSuccess) fail("cudaStreamSynchronize(config check)");
  if (cudaMemcpy(all.data(), device, sizeof(double) * all.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
    fail("cudaMemcpy(config check)");
  cudaFree(device);
  cudaStreamDestroy(stream);
  for (int r = 0; r < ep_size; ++r) {
    for (size_t i = 0; i < n; ++i) {
      if (all[size_t(r) * n + i] == mine[i]) continue;
      throw InvalidArgument(fields[i].first, "differs between the ranks of the communicator: rank " + std::to_string(r) +
                                                 " has " + std::to_string(all[size_t(r) * n + i]) + ", rank " +
                                                 std::to_string(rank) + " has " + std::to_string(mine[i]) +
                                                 " (every rank creates its context with the same Config)");
    }
  }
}

}  // namespace

std::unique_ptr<Context> Context::create_from_nccl(const Config& config, ncclComm* comm,
                                                   const ContextOptions& options) {
  if (comm == nullptr) throw InvalidArgument("comm", "must be an initialized NCCL communicator, got null");
  int version = 0;
  nccl_check(ncclGetVersion(&version), "ncclGetVersion");
  if (version < 22800) {
    throw NotAvailable("create_from_nccl needs NCCL >= 2.28 (symmetric windows, LSA device API); the loaded "
                       "libnccl is " + version_string(version));
  }
  // NcclTransport reads the peers' LSA pointers with device code compiled against this build's NCCL
  // headers; that device API is new, so the loaded library must be the same minor release.
  if (version / 100 != NCCL_VERSION_CODE / 100) {
    throw NotAvailable("create_from_nccl: Poise was built against NCCL " + version_string(NCCL_VERSION_CODE) +
                       " (window device API) but the loaded libnccl is " + version_string(version) +
                       "; build Poise against the NCCL it runs with");
  }
  int ep_size = 0, rank = 0, device = -1;
  nccl_check(ncclCommCount(comm, &ep_size), "ncclCommCount");
  nccl_check(ncclCommUserRank(comm, &rank), "ncclCommUserRank");
  nccl_check(ncclCommCuDevice(comm, &device), "ncclCommCuDevice");
  config.validate(ep_size);  // InvalidArgument naming the field, before any allocation
  if (device < 0 || device >= cuda_device_count() || !is_sm90_device(device)) {
    throw DeviceError("create_from_nccl: the communicator's CUDA device " + std::to_string(device) +
                      " is not an SM90 GPU (H100/H200); the CPU semantics are in poise::reference");
  }
  const runtime::CurrentDevice on_comm_device(device, "create_from_nccl");  // for the allocations
  require_same_config_on_every_rank(config, comm, ep_size, rank);
  // NcclTransport::create throws NotAvailable naming GIN when the LSA (NVLink) team is smaller than
  // the communicator, before it allocates anything.
  return ContextAccess::with_pipeline(
      config, ep_size, rank, options, [&](const ep::PipelineOptions& pipeline_options) {
        auto transport = comm::NcclTransport::create(
            comm, ep::StagedPipeline::workspace_bytes(config, ep_size, pipeline_options), pipeline_options.timeout_ns);
        return ep::StagedPipeline::create(config, std::move(transport), pipeline_options);
      });
}

}  // namespace poise
