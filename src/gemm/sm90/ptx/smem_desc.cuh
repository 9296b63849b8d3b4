// wgmma shared-memory matrix descriptors for 128-byte-swizzled bf16 tiles written by TMA.
//
// Two operand layouts, both built from 128-byte rows (64 bf16) in 1024-byte swizzle atoms:
//  - K-major  (K contiguous): smem row r holds 64 K-values of MN-index r. Consecutive 8-row
//    groups are 1024 B apart (SBO); LBO is unused. A k16 slice starts 32 B further along the row.
//  - MN-major (MN contiguous): a "chunk" is [64 K rows][64 MN values]; chunks for MN 64..127,
//    128..191, ... follow every kMnChunkBytes (LBO). 8-K-row groups are 1024 B apart (SBO).
//    A k16 slice starts 16 rows = 2048 B further.
#pragma once

#include <cstdint>

namespace poise::sm90::ptx {

inline constexpr uint32_t kSwizzleAtomBytes = 1024;  // 8 rows x 128 B
inline constexpr uint32_t kTileK = 64;                // K elements per pipeline stage (one 128 B row)
inline constexpr uint32_t kMnChunkBytes = kTileK * 128;  // one MN-major chunk: 64 K rows x 128 B

__device__ __forceinline__ uint64_t encode_desc_field(uint32_t bytes) {
  return static_cast<uint64_t>((bytes & 0x3FFFF) >> 4);
}

// Descriptor for an operand whose tile starts at `smem_ptr` (1024-byte aligned for base offset 0).
__device__ __forceinline__ uint64_t make_smem_desc(const void* smem_ptr, uint32_t leading_bytes,
                                                   uint32_t stride_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  uint64_t desc = encode_desc_field(addr);
  desc |= encode_desc_field(leading_bytes) << 16;
  desc |= encode_desc_field(stride_bytes) << 32;
  desc |= 1ull << 62;  // 128-byte swizzle
  return desc;
}

__device__ __forceinline__ uint64_t make_k_major_desc(const void* tile) {
  return make_smem_desc(tile, 16, kSwizzleAtomBytes);
}
__device__ __forceinline__ uint64_t make_mn_major_desc(const void* tile) {
  return make_smem_desc(tile, kMnChunkBytes, kSwizzleAtomBytes);
}

// Byte step between consecutive k16 slices inside one stage, by operand layout.
template <bool kMnMajor>
__device__ __forceinline__ constexpr uint32_t k16_slice_bytes() {
  return kMnMajor ? 16 * 128 : 16 * 2;
}

// Adds a byte offset to a descriptor's start address (addresses are encoded in 16-byte units).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return desc + static_cast<uint64_t>(bytes >> 4);
}

}  // namespace poise::sm90::ptx
