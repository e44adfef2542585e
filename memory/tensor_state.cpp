#include "strata/memory/tensor_state.h"

namespace strata::memory {

const char* tensor_state_name(TensorState state) {
  switch (state) {
    case TensorState::kFree: return "FREE";
    case TensorState::kCompute: return "COMPUTE";
    case TensorState::kHold: return "HOLD";
    case TensorState::kHoldAfterBwd: return "HOLD_AFTER_BWD";
    case TensorState::kReadyForReduce: return "READY_FOR_REDUCE";
  }
  return "UNKNOWN";
}

bool is_legal_transition(TensorState from, TensorState to) {
  using S = TensorState;
  switch (from) {
    case S::kFree: return to == S::kHold;
    case S::kHold: return to == S::kCompute || to == S::kFree;
    case S::kCompute: return to == S::kHold || to == S::kHoldAfterBwd;
    case S::kHoldAfterBwd: return to == S::kCompute || to == S::kReadyForReduce || to == S::kHold;
    case S::kReadyForReduce: return to == S::kHold || to == S::kFree;
  }
  return false;
}

}  // namespace strata::memory
