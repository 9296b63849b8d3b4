#include "runtime/host_backed_range.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "poise/errors.hpp"
#include "runtime/current_device.hpp"
#include "runtime/driver_entry_point.hpp"

namespace poise::runtime {
namespace {

// The driver's VMM entry points (driver_entry_point).
struct Vmm {
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  bool complete = false;
};

template <class Fn>
bool fetch(const char* name, Fn& fn) {
  fn = reinterpret_cast<Fn>(driver_entry_point(name));
  return fn != nullptr;
}

const Vmm& vmm() {
  static const Vmm fetched = [] {
    Vmm v;
    v.complete = fetch("cuDeviceGet", v.device_get) && fetch("cuDeviceGetAttribute", v.device_attribute) &&
                 fetch("cuMemGetAllocationGranularity", v.granularity) &&
                 fetch("cuMemAddressReserve", v.reserve) && fetch("cuMemAddressFree", v.address_free) &&
                 fetch("cuMemCreate", v.create) && fetch("cuMemRelease", v.release) && fetch("cuMemMap", v.map) &&
                 fetch("cuMemUnmap", v.unmap) && fetch("cuMemSetAccess", v.set_access);
    return v;
  }();
  return fetched;
}

void check(CUresult r, const char* call) {
  if (r != CUDA_SUCCESS) {
    throw DeviceError(std::string("host-backed range: ") + call + " failed (CUresult " +
                      std::to_string(static_cast<int>(r)) + ")");
  }
}

int attribute(const Vmm& v, CUdevice device, CUdevice_attribute which) {
  int value = 0;
  return v.device_attribute(&value, which, device) == CUDA_SUCCESS ? value : 0;
}

CUmemAllocationProp pinned_at(CUmemLocationType type, int id) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = type;
  prop.location.id = id;
  return prop;
}

// Where the host tail lives on `device`: its allocation properties (HostLocation::none: none).
HostLocation host_prop(const Vmm& v, CUdevice device, CUmemAllocationProp& prop) {
  if (!attribute(v, device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)) return HostLocation::none;
  if (attribute(v, device, CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)) {
    prop = pinned_at(CU_MEM_LOCATION_TYPE_HOST, 0);
    return HostLocation::host;
  }
  if (attribute(v, device, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)) {
    int numa = -1;
    if (v.device_attribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, device) != CUDA_SUCCESS || numa < 0) numa = 0;
    prop = pinned_at(CU_MEM_LOCATION_TYPE_HOST_NUMA, numa);
    return HostLocation::host_numa;
  }
  return HostLocation::none;
}

size_t round_up(size_t bytes, size_t granularity) { return (bytes + granularity - 1) / granularity * granularity; }

}  // namespace

HostLocation host_location_of(int device) {
  const Vmm& v = vmm();
  CUdevice d = 0;
  if (!v.complete || v.device_get(&d, device) != CUDA_SUCCESS) return HostLocation::none;
  CUmemAllocationProp prop{};
  return host_prop(v, d, prop);
}

HostBackedLayout host_backed_layout(size_t device_bytes, size_t host_bytes, size_t device_granularity,
                                    size_t host_granularity) {
  HostBackedLayout layout;
  layout.alignment = std::max(device_granularity, host_granularity);
  // The device part is rounded to both granularities: the host part is mapped where it ends.
  layout.device_part_bytes = round_up(std::max<size_t>(device_bytes, 1), layout.alignment);
  layout.host_part_bytes = host_bytes == 0 ? 0 : round_up(host_bytes, host_granularity);
  return layout;
}

HostBackedRange::HostBackedRange(int device, size_t device_bytes, size_t host_bytes) {
  const Vmm& v = vmm();
  if (!v.complete) throw DeviceError("host-backed range: the CUDA driver offers no virtual memory management calls");
  CurrentDevice current(device, "host-backed range");
  if (cudaFree(nullptr) != cudaSuccess) throw DeviceError("host-backed range: cannot initialize CUDA device " +
                                                          std::to_string(device));
  CUdevice d = 0;
  check(v.device_get(&d, device), "cuDeviceGet");
  const CUmemAllocationProp device_prop = pinned_at(CU_MEM_LOCATION_TYPE_DEVICE, device);
  CUmemAllocationProp host = {};
  if (host_bytes > 0) {
    host_location_ = host_prop(v, d, host);
    if (host_location_ == HostLocation::none) {
      throw DeviceError("host-backed range: CUDA device " + std::to_string(device) +
                        " cannot map host memory through virtual memory management (driver or device lacks "
                        "CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED and its NUMA form)");
    }
  }
  size_t device_granularity = 0, host_granularity = 1;
  check(v.granularity(&device_granularity, &device_prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity (device)");
  if (host_bytes > 0) {
    check(v.granularity(&host_granularity, &host, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
          "cuMemGetAllocationGranularity (host)");
  }
  layout_ = host_backed_layout(device_bytes, host_bytes, device_granularity, host_granularity);
  const size_t total = layout_.device_part_bytes + layout_.host_part_bytes;
  try {
    CUdeviceptr base = 0;
    check(v.reserve(&base, total, layout_.alignment, 0, 0), "cuMemAddressReserve");
    base_ = static_cast<uintptr_t>(base);
    check(v.create(&device_handle_, layout_.device_part_bytes, &device_prop, 0), "cuMemCreate (device part)");
    check(v.map(base, layout_.device_part_bytes, 0, device_handle_, 0), "cuMemMap (device part)");
    device_mapped_ = true;
    if (layout_.host_part_bytes > 0) {
      check(v.create(&host_handle_, layout_.host_part_bytes, &host, 0), "cuMemCreate (host part)");
      check(v.map(base + layout_.device_part_bytes, layout_.host_part_bytes, 0, host_handle_, 0),
            "cuMemMap (host part)");
      host_mapped_ = true;
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(v.set_access(base, total, &access, 1), "cuMemSetAccess");
  } catch (...) {
    release();
    throw;
  }
}

HostBackedRange::~HostBackedRange() { release(); }

void HostBackedRange::release() noexcept {
  const Vmm& v = vmm();
  if (base_ == 0 || !v.complete) return;
  const CUdeviceptr base = static_cast<CUdeviceptr>(base_);
  if (host_mapped_) v.unmap(base + layout_.device_part_bytes, layout_.host_part_bytes);
  if (device_mapped_) v.unmap(base, layout_.device_part_bytes);
  if (host_handle_ != 0) v.release(host_handle_);
  if (device_handle_ != 0) v.release(device_handle_);
  v.address_free(base, layout_.device_part_bytes + layout_.host_part_bytes);
  base_ = 0;
  host_handle_ = device_handle_ = 0;
  host_mapped_ = device_mapped_ = false;
}

}  // namespace poise::runtime
