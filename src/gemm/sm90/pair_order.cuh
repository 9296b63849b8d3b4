// The order in which 2-CTA clusters walk one expert's tiles (tile_scheduler.cuh), as pure
// __host__ __device__ functions: the kernels call them per tile, tests/cpp/test_pair_order.cpp
// checks on the host that every tile is computed exactly once, by a pair that shares an operand.
//
// An expert has m_blocks x n_blocks tiles. Its groups (one per cluster step):
//  - full pairs: M blocks 2i, 2i + 1 of one N block (they share B), N block major;
//  - for an odd m_blocks, the last M block's pairs over N blocks 2j, 2j + 1 (they share A); with an
//    odd n_blocks the last such pair's second CTA has no tile (valid = false: it loads its share of
//    A for its peer and computes nothing).
// The last-block pairs come after all full pairs, or, with `beside`, each right after the full
// pairs of the two N blocks it covers: it then reads their weight slices while the L2 holds them
// (DeepSeek-V3's fprop W13 reads 2.97 instead of 3.79 GB from DRAM).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define POISE_PAIR_HD __host__ __device__ __forceinline__
#else
#define POISE_PAIR_HD inline
#endif

namespace poise::sm90 {

// Groups of an expert with m_blocks x n_blocks tiles.
POISE_PAIR_HD int32_t pair_groups(int32_t m_blocks, int32_t n_blocks) {
  return m_blocks / 2 * n_blocks + m_blocks % 2 * ((n_blocks + 1) / 2);
}

// Whether the last-block pairs go beside their N blocks' full pairs: where the expert's full pairs
// span more than half a wave of the launch's clusters, so that walking them all first would start
// the last-block pairs after the L2 let their weight slices go (Qwen3's 12-16 full pairs per expert
// all start within a few microseconds either way).
POISE_PAIR_HD bool remainder_beside_pairs(int32_t m_pairs, int32_t n_blocks, uint32_t clusters) {
  return static_cast<uint32_t>(2 * m_pairs * n_blocks) > clusters;
}

// Group `local` of the expert as CTA `rank` (0 or 1) of its cluster computes it: its M and N block;
// a last-block pair sets shares_a, clears shares_b and sets valid (false for a filler), a full pair
// leaves them as they are (shares B, valid).
POISE_PAIR_HD void pair_tile(int32_t local, int32_t rank, int32_t m_blocks, int32_t n_blocks, bool beside,
                             int32_t& m_block, int32_t& n_block, bool& shares_a, bool& shares_b, bool& valid) {
  const int32_t m_pairs = m_blocks / 2;
  // pair: the index among the full pairs (N block major); last: a last-block pair, over N blocks
  // last_n, last_n + 1.
  int32_t pair = local, last_n = 2 * (local - m_pairs * n_blocks);
  bool last = local >= m_pairs * n_blocks;
  if (beside && (m_blocks & 1)) {
    // Units of N blocks 2u, 2u + 1: their full pairs (half as many for a lone last N block), then
    // the last M block's pair over both.
    const int32_t unit_size = 2 * m_pairs + 1, u = local / unit_size, in_unit = local - u * unit_size;
    last = in_unit >= (2 * u + 1 < n_blocks ? 2 * m_pairs : m_pairs);
    pair = 2 * u * m_pairs + in_unit;
    last_n = 2 * u;
  }
  if (!last) {  // M blocks 2i, 2i + 1 of one N block
    m_block = 2 * (pair % m_pairs) + rank;
    n_block = pair / m_pairs;
  } else {  // the odd last M block: N blocks last_n, last_n + 1
    shares_a = true;
    shares_b = false;
    m_block = m_blocks - 1;
    n_block = last_n + rank;
    valid = n_block < n_blocks;
  }
}

}  // namespace poise::sm90

#undef POISE_PAIR_HD
