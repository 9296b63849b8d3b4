// poise._poise_nccl: the communicator-backed Context for python/poise/nccl_context.py.
//
// Poise owns the communicator here: create_context() runs ncclCommInitRank from a unique id that
// rank 0 drew (unique_id()) and the Python side broadcast through the torch.distributed group, then
// Context::create_from_nccl; the communicator is destroyed right after the context's pipeline (its
// window) is released, by close() or the context's destruction.
//
// The returned object is poise._poise.Context (nanobind finds the type that module registered), so
// poise.Context and the torch ops use it like any other context. Both modules link their own copy
// of the static poise libraries: the Context crosses as an object built from the same sources (same
// layout), its transport through its virtual interface.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "runtime/current_device.hpp"
#include "comm/nccl_check.hpp"
#include "api/context_internal.hpp"
#include "poise/errors.hpp"
#include "poise/nccl.hpp"
#include "bindings/python/bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace poise::python {
namespace {

using comm::nccl_check;

int loaded_nccl_version() {
  int version = 0;
  nccl_check(ncclGetVersion(&version), "ncclGetVersion");
  return version;
}

nb::bytes unique_id() {
  ncclUniqueId id;
  nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return nb::bytes(id.internal, sizeof(id.internal));
}

// A device this process can make current: InvalidArgument naming "device" otherwise.
void require_cuda_device(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    throw DeviceError("create_context: no CUDA device; a communicator-backed context needs an SM90 GPU");
  }
  if (device < 0 || device >= count) {
    throw InvalidArgument("device", "must be a CUDA device index in [0, " + std::to_string(count) + "), got " +
                                        std::to_string(device));
  }
}

// Collective over the nranks processes holding the same id.
std::unique_ptr<Context> create_context(const Config& config, nb::bytes id_bytes, int nranks, int rank, int device,
                                        uint64_t wait_timeout_ns) {
  ncclUniqueId id;
  if (id_bytes.size() != sizeof(id.internal)) {
    throw InvalidArgument("unique_id", "must be the " + std::to_string(sizeof(id.internal)) +
                                           " bytes of an ncclUniqueId, got " + std::to_string(id_bytes.size()));
  }
  std::memcpy(id.internal, id_bytes.c_str(), sizeof(id.internal));
  if (nranks < 1) throw InvalidArgument("nranks", "must be >= 1, got " + std::to_string(nranks));
  if (rank < 0 || rank >= nranks) {
    throw InvalidArgument("rank", "must be in [0, nranks=" + std::to_string(nranks) + "), got " + std::to_string(rank));
  }
  nb::gil_scoped_release release;  // collective: other ranks' threads (if any) must get to run
  require_cuda_device(device);
  // Current for the communicator and the context's buffers; the caller's device comes back after.
  const runtime::CurrentDevice scope(device, "create_context");
  ncclComm_t comm = nullptr;
  nccl_check(ncclCommInitRank(&comm, nranks, id, rank), "ncclCommInitRank");
  // Owned from here on: destroyed on failure below, else after the context's pipeline is released.
  std::shared_ptr<void> owned(comm, [](void* c) { ncclCommDestroy(static_cast<ncclComm_t>(c)); });
  std::unique_ptr<Context> context = Context::create_from_nccl(config, comm, {.wait_timeout_ns = wait_timeout_ns});
  ContextAccess::release_after_pipeline(*context, std::move(owned));
  return context;
}

}  // namespace
}  // namespace poise::python

NB_MODULE(_poise_nccl, m) {
  using namespace poise::python;
  m.doc() = "poise.Context over an NCCL communicator owned by Poise (see poise/nccl_context.py).";
  // poise::InvalidArgument / NotAvailable / DeviceError thrown by this module's copy of the
  // library become poise.errors' classes, as in poise._poise.
  register_error_translator();
  m.attr("build_nccl_version") = NCCL_VERSION_CODE;
  m.def("nccl_version", &loaded_nccl_version, "NCCL_VERSION_CODE of the libnccl.so.2 this process loaded.");
  m.def("unique_id", &unique_id, "ncclGetUniqueId as bytes (rank 0 draws it; every rank passes it to create_context).");
  m.def("create_context", &create_context, "config"_a, "unique_id"_a, "nranks"_a, "rank"_a, "device"_a,
        "wait_timeout_ns"_a = poise::ContextOptions{}.wait_timeout_ns,
        "Collective: ncclCommInitRank(nranks, unique_id, rank) on CUDA device `device`, then "
        "Context::create_from_nccl over it. Returns a poise._poise.Context owning the communicator.");
  m.def(
      "_planned_context", [](const poise::Config& config) { return poise::Context::create(config, 1, 0); }, "config"_a,
      "Test hook (no GPU): a one-rank Context made by this module's copy of the library, to check that it "
      "comes back as a poise._poise.Context.");
}
