// Context::create_from_nccl (poise/nccl.hpp): the staged pipeline over an NcclTransport, installed
// into a Context through ContextAccess, so the poise library itself never links NCCL.
#include <cuda_runtime.h>

#include <string>

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
