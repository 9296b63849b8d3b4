// Reading a grouped-GEMM launch's fault word on the host.
#include <cuda_runtime.h>

#include <string>

#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/fault_word.hpp"
#include "poise/errors.hpp"

namespace poise::sm90 {
namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw DeviceError(std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace

PipelineFault read_pipeline_fault(const FaultWord& faults, cudaStream_t stream) {
  if (faults.word == nullptr) throw InvalidArgument("faults.word", "must be a device pointer");
  unsigned long long word = 0;
  check_cuda(cudaMemcpyAsync(&word, faults.word, sizeof(word), cudaMemcpyDeviceToHost, stream), "read_pipeline_fault");
  check_cuda(cudaStreamSynchronize(stream), "read_pipeline_fault: cudaStreamSynchronize");
  return unpack_pipeline_fault(word);
}

PipelineFault take_pipeline_fault(const FaultWord& faults, cudaStream_t stream) {
  const PipelineFault f = read_pipeline_fault(faults, stream);
  if (!f.occurred) return f;
  check_cuda(cudaMemsetAsync(faults.word, 0, sizeof(unsigned long long), stream), "take_pipeline_fault");
  check_cuda(cudaStreamSynchronize(stream), "take_pipeline_fault: cudaStreamSynchronize");
  return f;
}

PipelineFault unpack_pipeline_fault(unsigned long long word) {
  PipelineFault f;
  if (word == 0) return f;
  using Word = PipelineFaultWord;
  f.occurred = true;
  f.block = static_cast<int32_t>(Word::block(word));
  f.thread = static_cast<int32_t>(Word::thread(word));
  f.bad_origin = Word::barrier(word) == Word::kBadOrigin;
  f.barrier = f.bad_origin ? 0 : Word::barrier(word);
  f.parity = f.bad_origin ? 0 : Word::parity(word);
  return f;
}

std::string describe(const PipelineFault& f) {
  if (!f.occurred) return "";
  const std::string where = "block " + std::to_string(f.block) + ", thread " + std::to_string(f.thread);
  if (f.bad_origin)
    return "a row's row_origin_R entry named no slot of its owners (" + where + "): the row scatter stored it nowhere";
  return "a pipeline wait timed out (" + where + ", barrier at shared offset " + std::to_string(f.barrier) +
         ", parity " + std::to_string(f.parity) + "); that launch's outputs are invalid";
}

}  // namespace poise::sm90
