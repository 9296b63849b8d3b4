// In-process transport between virtual ranks (threads): a shared mailbox of R x R slots plus a
// barrier. Each exchange is put -> barrier -> take -> barrier, so slot [src][dst] is written only by
// src and read only by dst, never at the same time. A rank that fails calls abort(): its peers
// wake at their next barrier and unwind with PeerAborted instead of waiting forever.
#pragma once

#include <any>
#include <atomic>
#include <barrier>
#include <functional>
#include <stdexcept>
#include <vector>

namespace poise::reference {

// Thrown in a rank whose peer failed; run_ranks reports the peer's error instead.
struct PeerAborted : std::runtime_error {
  PeerAborted() : std::runtime_error("a peer rank failed") {}
};

class InProcessTransport {
 public:
  explicit InProcessTransport(int num_ranks);

  int num_ranks() const { return num_ranks_; }

  // Collective: rank sends to_each_rank[dst] to every dst and returns what every src sent it.
  template <class Message>
  std::vector<Message> all_to_all(int rank, std::vector<Message> to_each_rank) {
    for (int dst = 0; dst < num_ranks_; ++dst) slot(rank, dst) = std::move(to_each_rank[dst]);
    barrier();
    std::vector<Message> from_each_rank;
    from_each_rank.reserve(num_ranks_);
    for (int src = 0; src < num_ranks_; ++src) {
      from_each_rank.push_back(std::any_cast<Message>(std::move(slot(src, rank))));
      slot(src, rank).reset();
    }
    barrier();
    return from_each_rank;
  }

  // Collective: every rank gets every rank's value, by rank.
  template <class Message>
  std::vector<Message> all_gather(int rank, const Message& mine) {
    return all_to_all(rank, std::vector<Message>(num_ranks_, mine));
  }

  // Collective. Throws PeerAborted when a peer has failed.
  void barrier();

  // Called once by a rank that leaves with an exception.
  void abort();

 private:
  std::any& slot(int src, int dst) { return mailbox_[static_cast<size_t>(src) * num_ranks_ + dst]; }

  int num_ranks_;
  std::vector<std::any> mailbox_;  // [src * R + dst]
  std::barrier<> barrier_;
  std::atomic<bool> aborted_{false};
};

// Runs body(rank, transport) on num_ranks threads and joins them. If ranks fail, rethrows the
// error of the lowest failing rank (a PeerAborted only when nothing else was thrown).
void run_ranks(int num_ranks, const std::function<void(int rank, InProcessTransport&)>& body);

}  // namespace poise::reference
