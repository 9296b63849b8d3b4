// The 2-CTA clusters' tile walk (src/gemm/sm90/pair_order.cuh), run on the host: the kernels call
// the same functions per tile (tile_scheduler.cuh). For every expert shape up to 40 x 40 blocks, in
// both orders:
//  - every tile is computed exactly once, and each group's two CTAs share an operand (full pairs:
//    M blocks 2i, 2i + 1 of one N block; last-block pairs: the last M block, N blocks 2j, 2j + 1);
//  - `beside` puts each last-block pair right after the full pairs of its two N blocks and before
//    any full pair of a later N block; without it every full pair comes first.
#include <gtest/gtest.h>

#include <vector>

#include "gemm/sm90/pair_order.cuh"

namespace poise::sm90 {
namespace {

struct Tile {
  int32_t m_block = -1, n_block = -1;
  bool shares_a = false, shares_b = true, valid = true;  // as the scheduler starts a pair's tile
};

Tile tile_of(int local, int rank, int m_blocks, int n_blocks, bool beside) {
  Tile t;
  pair_tile(local, rank, m_blocks, n_blocks, beside, t.m_block, t.n_block, t.shares_a, t.shares_b, t.valid);
  return t;
}

// Groups of one expert: (rank 0's tile, rank 1's tile), in walking order.
std::vector<std::pair<Tile, Tile>> walk(int m_blocks, int n_blocks, bool beside) {
  std::vector<std::pair<Tile, Tile>> groups;
  for (int g = 0; g < pair_groups(m_blocks, n_blocks); ++g)
    groups.emplace_back(tile_of(g, 0, m_blocks, n_blocks, beside), tile_of(g, 1, m_blocks, n_blocks, beside));
  return groups;
}

TEST(PairOrder, EveryTileOnceAndPairsShareAnOperand) {
  for (int m_blocks = 1; m_blocks <= 40; ++m_blocks) {
    for (int n_blocks = 1; n_blocks <= 40; ++n_blocks) {
      for (bool beside : {false, true}) {
        SCOPED_TRACE(testing::Message() << m_blocks << " x " << n_blocks << (beside ? " beside" : " after"));
        std::vector<int> computed(m_blocks * n_blocks, 0);
        for (const auto& [a, b] : walk(m_blocks, n_blocks, beside)) {
          ASSERT_TRUE(a.valid);  // only a second CTA can be a filler
          ASSERT_EQ(a.shares_a, b.shares_a);
          ASSERT_NE(a.shares_a, a.shares_b);
          if (a.shares_a) {  // the last M block over N blocks 2j, 2j + 1
            EXPECT_EQ(a.m_block, m_blocks - 1);
            EXPECT_EQ(b.m_block, a.m_block);
            EXPECT_EQ(a.n_block % 2, 0);
            EXPECT_EQ(b.n_block, a.n_block + 1);
            EXPECT_EQ(b.valid, b.n_block < n_blocks);
          } else {  // M blocks 2i, 2i + 1 of one N block
            ASSERT_TRUE(b.valid);
            EXPECT_EQ(a.m_block % 2, 0);
            EXPECT_EQ(b.m_block, a.m_block + 1);
            EXPECT_EQ(b.n_block, a.n_block);
          }
          for (const Tile* t : {&a, &b}) {
            if (!t->valid) continue;
            ASSERT_GE(t->m_block, 0);
            ASSERT_LT(t->m_block, m_blocks);
            ASSERT_GE(t->n_block, 0);
            ASSERT_LT(t->n_block, n_blocks);
            ++computed[t->m_block * n_blocks + t->n_block];
          }
        }
        for (int c : computed) ASSERT_EQ(c, 1);
      }
    }
  }
}

TEST(PairOrder, LastBlockPairsBesideTheirNBlocksOrAfterAll) {
  for (int m_blocks = 1; m_blocks <= 40; m_blocks += 2) {  // odd: there are last-block pairs
    for (int n_blocks = 1; n_blocks <= 40; ++n_blocks) {
      SCOPED_TRACE(testing::Message() << m_blocks << " x " << n_blocks);
      // Beside: the last-block pair over N blocks 2j, 2j + 1 follows every full pair of those N
      // blocks and precedes every full pair of N block 2j + 2 on.
      const auto beside = walk(m_blocks, n_blocks, true);
      for (size_t g = 0; g < beside.size(); ++g) {
        if (!beside[g].first.shares_a) continue;
        const int first_n = beside[g].first.n_block;
        for (size_t h = 0; h < beside.size(); ++h) {
          const Tile& t = beside[h].first;
          if (t.shares_a) continue;
          if (t.n_block <= first_n + 1) EXPECT_LT(h, g) << "full pair of N block " << t.n_block;
          else EXPECT_GT(h, g) << "full pair of N block " << t.n_block;
        }
      }
      // After: every full pair first, then the last-block pairs in N order.
      const auto after = walk(m_blocks, n_blocks, false);
      const size_t full = static_cast<size_t>(m_blocks / 2 * n_blocks);
      for (size_t g = 0; g < after.size(); ++g) {
        EXPECT_EQ(after[g].first.shares_a, g >= full);
        if (g >= full) EXPECT_EQ(after[g].first.n_block, static_cast<int>(2 * (g - full)));
      }
    }
  }
}

TEST(PairOrder, BesideOnlyWhereFullPairsSpanMoreThanHalfAWave) {
  // The bench's shapes on the H200's 66 pair clusters: DeepSeek-V3's odd experts (4 full pairs per N
  // block; 16 or 28 N blocks) beside, Qwen3's (2 per N block; 6 or 8 N blocks) not.
  EXPECT_TRUE(remainder_beside_pairs(4, 16, 66));
  EXPECT_TRUE(remainder_beside_pairs(4, 28, 66));
  EXPECT_FALSE(remainder_beside_pairs(2, 6, 66));
  EXPECT_FALSE(remainder_beside_pairs(2, 8, 66));
  // The threshold: 2 x full pairs > clusters.
  EXPECT_FALSE(remainder_beside_pairs(1, 33, 66));  // 33 full pairs: exactly half a wave
  EXPECT_TRUE(remainder_beside_pairs(1, 34, 66));
  EXPECT_FALSE(remainder_beside_pairs(0, 40, 66));  // no full pairs at all
}

}  // namespace
}  // namespace poise::sm90
