// POISE_HD: code that the host (the reference engine, the planners) and the device (the kernels)
// both compile, so that both compute the same bits.
#pragma once

#if defined(__CUDACC__)
#define POISE_HD __host__ __device__
#else
#define POISE_HD
#endif
