#pragma once
// The lifecycle of one tensor inside a chunk (Gemini's and PatrickStar's
// machine). Legal transitions:
//
//   FREE ──► HOLD ◄──────────────► COMPUTE ──► HOLD_AFTER_BWD ──► READY_FOR_REDUCE
//    ▲        │  (op starts/ends)      ▲             │  │                │   │
//    └────────┘                        └─────────────┘  └──► HOLD        │   │
//    (released)                      (reused in bwd)                      │   │
//    FREE ◄───────────────────────────────────────────────────────────────┘   │
//    HOLD ◄───────────────────────────────────────────────────────────────────┘
//
// Anything else, including a state to itself, is an error: it means a hook
// fired twice or out of order, which would otherwise corrupt a reduction.

#include <cstdint>
#include <string>

namespace strata::memory {

enum class TensorState : uint8_t {
  kFree = 0,            // no payload needed (released, or not yet materialised)
  kCompute = 1,         // an operator is using it: its chunk is pinned where it is
  kHold = 2,            // payload valid, not in use
  kHoldAfterBwd = 3,    // used in backward; its gradient is being produced
  kReadyForReduce = 4,  // gradient is in its slot, ready to be reduced
};
constexpr int kNumTensorStates = 5;

const char* tensor_state_name(TensorState state);
bool is_legal_transition(TensorState from, TensorState to);

}  // namespace strata::memory
