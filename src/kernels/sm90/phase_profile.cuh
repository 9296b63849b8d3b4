// Where a grouped GEMM's SM cycles go, in profiling builds only.
#pragma once

// Profiling builds only (scripts/build_bench_variant.sh NAME -DPOISE_PHASE_PROFILE=1, then
// bench/expert_mlp/profile_gemm.py LIB SHAPE phases): where the SM cycles go, summed over every
// consumer warpgroup of every launch: [0] the consumer loop, [1] waiting for a stage to land,
// [2] epilogues, [3] tiles; [4] the producer waiting for a free stage, [5] the producer loop; epilogues that
// split their own time (SwiGLU backward): [6] waiting for their ring stages, [7] emitting and
// releasing them (thread 0 of each warpgroup).
// Read and reset on the host with read_phase_profile (expert_mlp.cu).
#ifndef POISE_PHASE_PROFILE
#define POISE_PHASE_PROFILE 0
#endif
#if POISE_PHASE_PROFILE
__device__ unsigned long long g_phase_cycles[8];
#define POISE_PHASE(...) __VA_ARGS__
#else
#define POISE_PHASE(...)
#endif
