// Internal hook for Context factories that live outside context.cpp (e.g. create_from_nccl in the
// poise_nccl library): they build the StagedPipeline over their own transport and install it here,
// so context.cpp never depends on NCCL.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "pipeline/staged_pipeline.hpp"
#include "poise/context.hpp"

namespace poise {

struct ContextAccess {
  using MakePipeline = std::function<std::unique_ptr<ep::StagedPipeline>(const ep::PipelineOptions&)>;

  // A one-launch-rank context for rank `rank` of an ep_size group (config validated and planned
  // first), whose pipeline is make_pipeline(options): options are the ones the context's own
  // pipelines get (its plan's replica slots and activation records, the wait timeout).
  static std::unique_ptr<Context> with_pipeline(const Config& config, int64_t ep_size, int64_t rank,
                                                const ContextOptions& options, const MakePipeline& make_pipeline);

  // Keeps `resource` alive until the context's pipeline has been released (close() or destruction),
  // then releases it: e.g. a communicator the context owns, which must outlive its window.
  static void release_after_pipeline(Context& context, std::shared_ptr<void> resource);
};

}  // namespace poise
