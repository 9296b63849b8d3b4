// poise::Context over an NCCL communicator: one rank per process (one GPU each), the ranks reached
// through NVLink (NCCL's LSA team). Library: poise_nccl (find_package(Poise): Poise::poise_nccl),
// built where NCCL >= 2.28 with nccl_device.h is found. Linking it makes the program need
// libnccl.so.2; poise/context.hpp and the poise library do not.
//
//   ncclComm_t comm;                          // the caller's: every rank of the EP group
//   ncclCommInitRank(&comm, nranks, id, rank);  // (cudaSetDevice first, as NCCL asks)
//   auto context = poise::Context::create_from_nccl(config, comm);   // collective
//   poise::routed_experts_forward(*context, args, stream);           // launch_ranks() == 1
//   context->close();                         // collective; then ncclCommDestroy(comm)
//
// Contract of Context::create_from_nccl(config, comm, options):
//  - Collective over `comm`: every rank calls it with the same Config, in the same order relative
//    to other collectives on `comm`.
//  - ep_size = the communicator's size, rank = this process's rank in it; the Context's memory plan
//    uses them; launch_ranks() == 1 (one argument set per call).
//  - Allocates now, on the communicator's CUDA device: the symmetric workspace (ncclMemAlloc,
//    registered as an NCCL window) and the pipeline buffers. Calls must run with that device current.
//  - The communicator stays the caller's: keep it alive until the context is closed (close() or
//    destruction, both collective: the window is deregistered), then destroy it.
//  - Ranks outside one NVLink domain (the LSA team smaller than the communicator) would need NCCL
//    GIN, which this build does not implement: NotAvailable, before anything is allocated.
//  - Errors: InvalidArgument("comm") for a null communicator, InvalidArgument naming the Config
//    field, NotAvailable (GIN, NCCL < 2.28), DeviceError (no SM90 GPU, NCCL or CUDA failures).
#pragma once

#include <nccl.h>

#include <type_traits>

#include "poise/context.hpp"

static_assert(std::is_same_v<ncclComm_t, ncclComm*>, "poise/context.hpp declares ncclComm_t as ncclComm*");
