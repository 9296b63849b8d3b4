// A self-check of a transport: every block of every rank puts a tagged word into the next
// rank's workspace, then all ranks meet in a barrier; a second launch checks what arrived.
// Used by the transport tests and as a smoke test of a fresh NCCL window.
#pragma once

#include <cuda_runtime.h>

#include "comm/transport.hpp"

namespace poise::comm {

// Workspace bytes the probe needs for `blocks_per_rank` blocks per rank.
size_t barrier_probe_workspace_bytes(int world, int blocks_per_rank);

// One round: puts, then barrier. `absent_rank` >= 0 makes that rank's blocks skip everything
// (a peer that never arrives). Returns after enqueueing.
void launch_barrier_probe_round(const Transport& t, int blocks_per_rank, int round, int absent_rank,
                                cudaStream_t stream);

// Counts words in this process's ranks that do not hold round `round`'s tag into *mismatches_device.
void launch_barrier_probe_check(const Transport& t, int blocks_per_rank, int round, int* mismatches_device,
                                cudaStream_t stream);

}  // namespace poise::comm
