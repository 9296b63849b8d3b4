#include "comm/transport.hpp"

#include <sstream>

namespace poise::comm {

const char* to_string(Phase phase) {
  switch (phase) {
    case Phase::none: return "none";
    case Phase::route_count: return "route (count)";
    case Phase::counts_exchange: return "route (counts exchange)";
    case Phase::route_assign: return "route (assign rows)";
    case Phase::dispatch: return "dispatch";
    case Phase::combine: return "combine";
    case Phase::dispatch_backward: return "dispatch (backward)";
    case Phase::combine_backward: return "combine (backward)";
    case Phase::barrier_probe: return "barrier";
  }
  return "unknown phase";
}

const char* to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::ok: return "ok";
    case ErrorCode::timeout: return "timeout";
    case ErrorCode::capacity_overflow: return "capacity overflow";
    case ErrorCode::bad_expert_id: return "expert id out of range";
    case ErrorCode::duplicate_expert_id: return "expert picked twice by one token";
    case ErrorCode::peer_failed: return "a peer rank failed";
    case ErrorCode::expert_gemm_fault: return "expert GEMM fault";
  }
  return "unknown error";
}

std::string describe(const ErrorWord& e, uint64_t timeout_ns) {
  std::ostringstream os;
  const auto code = static_cast<ErrorCode>(e.code);
  os << "rank " << e.rank << ", " << to_string(static_cast<Phase>(e.phase)) << ": ";
  switch (code) {
    case ErrorCode::ok: os << "no error"; break;
    case ErrorCode::timeout:
      os << "timed out after " << timeout_ns / 1000000.0 << " ms waiting for rank " << e.peer
         << " (barrier epoch " << e.value << ")";
      break;
    case ErrorCode::capacity_overflow:
      os << "capacity overflow: rank " << e.peer << " would receive " << e.value
         << " rows (padding included), more than its planned receive capacity; raise "
            "receive_capacity_factor";
      break;
    case ErrorCode::bad_expert_id:
      os << "ids_TK holds expert id " << e.value << " at token " << e.token << ", outside [0, E)";
      break;
    case ErrorCode::duplicate_expert_id:
      os << "ids_TK picks expert " << e.value << " more than once at token " << e.token
         << " (a token's top_k experts must be distinct)";
      break;
    case ErrorCode::peer_failed: os << "stopped: rank " << e.peer << " failed (its error names the cause)"; break;
    case ErrorCode::expert_gemm_fault: os << "an expert GEMM recorded a device fault"; break;
    default: os << "error code " << e.code;
  }
  return os.str();
}

}  // namespace poise::comm
