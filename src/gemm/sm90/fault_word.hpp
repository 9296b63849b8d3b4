// The fault word a grouped-GEMM launch records its first device fault in (fault.cuh), packed on the
// device and unpacked on the host: 0, or bit 63 | block << 32 | thread << 20 | barrier << 1 |
// parity, where barrier is the shared-memory offset (18 bits) of the mbarrier a timed-out wait was
// for, or one of the kinds below for a fault that is no wait.
#pragma once

namespace poise::sm90 {

struct PipelineFaultWord {
  static constexpr unsigned long long kValid = 1ull << 63;
  // A row scatter's row whose origin names no slot of its owners (no barrier lives at this offset:
  // shared memory ends below 0x3ffff).
  static constexpr unsigned kBadOrigin = 0x3ffffu;
  static constexpr unsigned long long pack(unsigned block, unsigned thread, unsigned barrier, unsigned parity) {
    return kValid | (static_cast<unsigned long long>(block) << 32) | (static_cast<unsigned long long>(thread) << 20) |
           (static_cast<unsigned long long>(barrier & 0x3ffffu) << 1) | (parity & 1u);
  }
  static constexpr unsigned block(unsigned long long w) { return static_cast<unsigned>((w >> 32) & 0x7fffffffu); }
  static constexpr unsigned thread(unsigned long long w) { return static_cast<unsigned>((w >> 20) & 0xfffu); }
  static constexpr unsigned barrier(unsigned long long w) { return static_cast<unsigned>((w >> 1) & 0x3ffffu); }
  static constexpr unsigned parity(unsigned long long w) { return static_cast<unsigned>(w & 1u); }
};

}  // namespace poise::sm90
