#include "reference/transport.hpp"

#include <exception>
#include <thread>

namespace poise::reference {

InProcessTransport::InProcessTransport(int num_ranks)
    : num_ranks_(num_ranks), mailbox_(static_cast<size_t>(num_ranks) * num_ranks), barrier_(num_ranks) {}

void InProcessTransport::barrier() {
  if (aborted_.load()) throw PeerAborted();
  barrier_.arrive_and_wait();
  if (aborted_.load()) throw PeerAborted();
}

void InProcessTransport::abort() {
  // The flag first: peers released by this arrival must see it.
  aborted_.store(true);
  barrier_.arrive_and_drop();
}

void run_ranks(int num_ranks, const std::function<void(int rank, InProcessTransport&)>& body) {
  InProcessTransport transport(num_ranks);
  std::vector<std::exception_ptr> errors(num_ranks);
  std::vector<char> peer_aborted(num_ranks, 0);  // not vector<bool>: threads write neighbours
  {
    std::vector<std::jthread> threads;
    threads.reserve(num_ranks);
    for (int rank = 0; rank < num_ranks; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          body(rank, transport);
        } catch (const PeerAborted&) {
          errors[rank] = std::current_exception();
          peer_aborted[rank] = 1;
          transport.abort();
        } catch (...) {
          errors[rank] = std::current_exception();
          transport.abort();
        }
      });
    }
  }  // jthreads join here
  for (int rank = 0; rank < num_ranks; ++rank) {
    if (errors[rank] && !peer_aborted[rank]) std::rethrow_exception(errors[rank]);
  }
  for (int rank = 0; rank < num_ranks; ++rank) {
    if (errors[rank]) std::rethrow_exception(errors[rank]);
  }
}

}  // namespace poise::reference
