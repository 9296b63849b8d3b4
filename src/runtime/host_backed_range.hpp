// One reserved virtual address range whose first part is device memory and whose tail is host
// memory mapped for the device (CUDA virtual memory management): a kernel indexes bytes past the
// device part without a branch, at the host link's speed instead of HBM's. Addresses stay fixed
// while the range lives, so CUDA graphs captured on it stay valid. The building block of
// host-backed overflow scratch (issue 39: rows past the planned device capacity spill to host).
#pragma once

#include <cstddef>
#include <cstdint>

namespace poise::runtime {

// How the host tail is backed: a host allocation (CU_MEM_LOCATION_TYPE_HOST), or one on the
// device's nearest host NUMA node where the driver only offers that.
enum class HostLocation { none, host, host_numa };

// What `device` offers for a host tail (none: no VMM host allocations; the driver or device lacks them).
HostLocation host_location_of(int device);

// The range's layout: each part rounded up to the allocation granularity of its location, so the
// device part ends on a boundary the host part can be mapped at.
struct HostBackedLayout {
  size_t device_part_bytes = 0;
  size_t host_part_bytes = 0;
  size_t alignment = 0;  // the larger of the two granularities: the range's start and the boundary
};
HostBackedLayout host_backed_layout(size_t device_bytes, size_t host_bytes, size_t device_granularity,
                                    size_t host_granularity);

class HostBackedRange {
 public:
  // At least device_bytes of device memory on `device`, then at least host_bytes of host memory
  // (0: none), readable and writable by `device`. Throws DeviceError naming the driver call that
  // failed, or, for host_bytes > 0 where host_location_of(device) is none, what is missing.
  HostBackedRange(int device, size_t device_bytes, size_t host_bytes);
  ~HostBackedRange();
  HostBackedRange(const HostBackedRange&) = delete;
  HostBackedRange& operator=(const HostBackedRange&) = delete;

  void* data() const { return reinterpret_cast<void*>(base_); }
  // Bytes [0, device_part_bytes) are device memory, [device_part_bytes, + host_part_bytes) host memory.
  size_t device_part_bytes() const { return layout_.device_part_bytes; }
  size_t host_part_bytes() const { return layout_.host_part_bytes; }
  HostLocation host_location() const { return host_location_; }

 private:
  void release() noexcept;

  HostBackedLayout layout_;
  HostLocation host_location_ = HostLocation::none;
  uintptr_t base_ = 0;                      // the reserved range (a CUdeviceptr)
  unsigned long long device_handle_ = 0;    // CUmemGenericAllocationHandle of each part; 0: none
  unsigned long long host_handle_ = 0;
  bool device_mapped_ = false, host_mapped_ = false;
};

}  // namespace poise::runtime
