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

// Profiling builds only (-DPOISE_TILE_TIMELINE=1, then profile_gemm.py LIB SHAPE timeline): each
// tile's start and end (globaltimer ns, consumer warpgroup 0's thread 0), its SM and what it is
// (expert << 16 | n_block << 8 | m_block), at index tile * cluster + rank, for the last launch: how
// far apart in time the tiles that share an operand run (performance.md, session 12).
#ifndef POISE_TILE_TIMELINE
#define POISE_TILE_TIMELINE 0
#endif
#if POISE_TILE_TIMELINE
inline constexpr int kTimelineTiles = 1 << 16;
__device__ unsigned long long g_tile_start_ns[kTimelineTiles], g_tile_end_ns[kTimelineTiles];
__device__ unsigned int g_tile_what[kTimelineTiles], g_tile_sm[kTimelineTiles];
__device__ __forceinline__ unsigned long long timeline_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned int timeline_smid() {
  unsigned int s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
#define POISE_TIMELINE(...) __VA_ARGS__
#else
#define POISE_TIMELINE(...)
#endif
