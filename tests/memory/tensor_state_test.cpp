// Every (from, to) pair of the tensor state machine, driven through the chunk manager.
#include <gtest/gtest.h>

#include "strata/core/error.h"
#include "strata/memory/chunk_manager.h"
#include "strata/offload/device_memory.h"

namespace strata::memory {
namespace {

using S = TensorState;

// The specification, written independently of is_legal_transition().
bool expected_legal(S from, S to) {
  static const bool table[kNumTensorStates][kNumTensorStates] = {
      //            FREE   COMPUTE HOLD   HOLD_AFTER_BWD READY_FOR_REDUCE
      /* FREE    */ {false, false, true, false, false},
      /* COMPUTE */ {false, false, true, true, false},
      /* HOLD    */ {true, true, false, false, false},
      /* H_A_BWD */ {false, true, true, false, true},
      /* READY   */ {true, false, true, false, false},
  };
  return table[static_cast<int>(from)][static_cast<int>(to)];
}

// A legal path from FREE to each state.
std::vector<S> path_to(S state) {
  switch (state) {
    case S::kFree: return {};
    case S::kHold: return {S::kHold};
    case S::kCompute: return {S::kHold, S::kCompute};
    case S::kHoldAfterBwd: return {S::kHold, S::kCompute, S::kHoldAfterBwd};
    case S::kReadyForReduce: return {S::kHold, S::kCompute, S::kHoldAfterBwd, S::kReadyForReduce};
  }
  return {};
}

ChunkManagerOptions small_options() {
  ChunkManagerOptions o;
  o.budgets = {1 << 20, 1 << 20, 0};
  o.device = offload::make_emulated_device_memory();
  return o;
}

TEST(TensorState, TableMatchesTheSpecification) {
  for (int f = 0; f < kNumTensorStates; ++f) {
    for (int t = 0; t < kNumTensorStates; ++t) {
      EXPECT_EQ(is_legal_transition(static_cast<S>(f), static_cast<S>(t)),
                expected_legal(static_cast<S>(f), static_cast<S>(t)))
          << tensor_state_name(static_cast<S>(f)) << " -> " << tensor_state_name(static_cast<S>(t));
    }
  }
}

TEST(TensorState, EveryTransitionThroughTheManager) {
  for (int f = 0; f < kNumTensorStates; ++f) {
    for (int t = 0; t < kNumTensorStates; ++t) {
      const S from = static_cast<S>(f), to = static_cast<S>(t);
      ChunkManager mgr(small_options());
      const Registration reg = mgr.register_tensors({{"layer.weight", 64}, {"layer.bias", 8}}, FamilySpec{}, 128);
      const ChunkId c = mgr.family(reg.families[0]).param;
      mgr.access(c, Tier::kHost);
      for (S step : path_to(from)) mgr.transition(c, 1, step);
      ASSERT_EQ(mgr.chunk(c).state(1), from);
      if (expected_legal(from, to)) {
        EXPECT_NO_THROW(mgr.transition(c, 1, to));
        EXPECT_EQ(mgr.chunk(c).state(1), to);
        EXPECT_EQ(mgr.chunk(c).compute_count(), to == S::kCompute ? 1 : 0);
      } else {
        try {
          mgr.transition(c, 1, to);
          ADD_FAILURE() << "accepted " << tensor_state_name(from) << " -> " << tensor_state_name(to);
        } catch (const Error& e) {
          const std::string msg = e.message();
          EXPECT_NE(msg.find(std::string(tensor_state_name(from)) + " -> " + tensor_state_name(to)),
                    std::string::npos) << msg;
          EXPECT_NE(msg.find("layer.bias"), std::string::npos) << msg;
        }
        EXPECT_EQ(mgr.chunk(c).state(1), from) << "a refused transition changes nothing";
        EXPECT_EQ(mgr.chunk(c).state(0), S::kFree);
      }
    }
  }
}

TEST(TensorState, ComputeNeedsAnAddressablePayload) {
  ChunkManager mgr(small_options());
  const Registration reg = mgr.register_tensors({{"w", 64}}, FamilySpec{}, 64);
  const ChunkId c = mgr.family(reg.families[0]).param;
  mgr.transition(c, 0, S::kHold);
  EXPECT_THROW(mgr.transition(c, 0, S::kCompute), Error) << "no payload yet";
  mgr.access(c, Tier::kDevice);
  EXPECT_NO_THROW(mgr.transition(c, 0, S::kCompute));
}

TEST(TensorState, SlotOutOfRangeIsAnError) {
  ChunkManager mgr(small_options());
  const Registration reg = mgr.register_tensors({{"w", 64}}, FamilySpec{}, 64);
  EXPECT_THROW(mgr.transition(mgr.family(reg.families[0]).param, 1, S::kHold), Error);
}

}  // namespace
}  // namespace strata::memory
