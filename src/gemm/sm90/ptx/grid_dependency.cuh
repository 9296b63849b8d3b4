// Programmatic dependent launch (sm_90): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel before it in the
// stream still runs. It does its setup (barriers, descriptor prefetch), then waits for the
// preceding grid to complete and its writes to be visible before reading any input. Without the
// launch attribute both instructions are no-ops, so the kernels stay correct under any launch.
#pragma once

namespace poise::sm90::ptx {

// Blocks the calling thread until every prerequisite grid has completed and its memory operations
// are visible. Every thread that reads inputs (or writes outputs a prerequisite may still read)
// executes it.
__device__ __forceinline__ void wait_for_prerequisite_grids() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Lets the next kernel in the stream be scheduled once every CTA of this grid executed this (or
// exited). Its CTAs then take SMs as ours leave and wait in wait_for_prerequisite_grids; the first
// execution per CTA counts, later ones have no effect.
__device__ __forceinline__ void allow_dependent_grids() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace poise::sm90::ptx
