// What GPU, if any, this process can use. Safe on machines without a driver.
#pragma once

namespace poise {

// Number of usable CUDA devices; 0 when there is no driver or no device (never throws).
int cuda_device_count();

// True when device `index` is an SM90 part (H100/H200) that can run the sm_90a kernels.
bool is_sm90_device(int index);

}  // namespace poise
