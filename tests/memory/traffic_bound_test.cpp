// Note [The least traffic of a step]: the closed forms against the cases
// worked by hand, and against the minimum over every split of the memory at
// t* between gradients and state, found by enumeration.
#include "strata/memory/traffic_bound.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

namespace strata::memory {
namespace {

TEST(TrafficBound, NothingMovesWhenTheStepFitsInMemory) {
  for (bool barrier : {true, false}) {
    const TrafficBound b = least_step_traffic({1200, 400, 1600, barrier});
    EXPECT_EQ(b.steady.total(), 0u);
    EXPECT_EQ(b.one_step.total(), 0u);
  }
}

TEST(TrafficBound, WithoutMemoryEveryByteGoesOutAndComesBack) {
  const TrafficBound b = least_step_traffic({1200, 400, 0, true});
  EXPECT_EQ(b.steady.read, 1600u);
  EXPECT_EQ(b.steady.written, 1600u);
  EXPECT_EQ(b.one_step.read, 1600u);
  EXPECT_EQ(b.one_step.written, 1600u);  // the gradients, then the state it updated
}

// strata bench scale's model: 2.95e9 parameters, fp32 AdamW (E = 12 bytes a
// parameter, G = 4), device 1 GiB and host 12 GiB.
TEST(TrafficBound, TheThreeBillionParameterStep) {
  const uint64_t p = 2950000000ull, gib = uint64_t{1} << 30;
  const TrafficBound b = least_step_traffic({12 * p, 4 * p, 13 * gib, true});
  EXPECT_EQ(b.steady.read, 16 * p - 13 * gib);
  EXPECT_EQ(b.steady.written, 16 * p - 13 * gib);
  // One step: the gradients fit in memory (G < M), so none is written; the
  // state read is E - (M - G), and E - M of the new state is written.
  EXPECT_EQ(b.one_step.read, 16 * p - 13 * gib);
  EXPECT_EQ(b.one_step.written, 12 * p - 13 * gib);
  // bf16 gradients (E = 12 with the fp32 masters, G = 2) halve the gradient bytes only.
  const TrafficBound h = least_step_traffic({12 * p, 2 * p, 13 * gib, true});
  EXPECT_EQ(h.steady.total(), 2 * (14 * p - 13 * gib));
}

TEST(TrafficBound, WithoutABarrierOnlyTheStateThatDoesNotFitMoves) {
  const TrafficBound b = least_step_traffic({1200, 400, 500, false});
  EXPECT_EQ(b.steady.read, 700u);
  EXPECT_EQ(b.steady.written, 700u);
  EXPECT_EQ(b.one_step.total(), 1400u);
}

// Every split (g, e) of the memory at t*: the step bound is the least one
// step can move over all of them, and the steady bound twice the least N.
TEST(TrafficBound, ClosedFormsAreTheMinimumOverEverySplit) {
  for (uint64_t e = 0; e <= 24; e += 3) {
    for (uint64_t g = 0; g <= 16; g += 2) {
      for (uint64_t m = 0; m <= 44; m += 1) {
        uint64_t least_step = std::numeric_limits<uint64_t>::max(), least_n = least_step;
        for (uint64_t gm = 0; gm <= std::min(g, m); ++gm) {
          for (uint64_t em = 0; em <= std::min(e, m - gm); ++em) {
            const uint64_t n = (g - gm) + (e - em);
            const uint64_t written = (g - gm) + (e > m ? e - m : 0);
            least_step = std::min(least_step, n + written);
            least_n = std::min(least_n, n);
          }
        }
        const TrafficBound b = least_step_traffic({e, g, m, true});
        ASSERT_EQ(b.one_step.total(), least_step) << "E " << e << " G " << g << " M " << m;
        ASSERT_EQ(b.steady.total(), 2 * least_n) << "E " << e << " G " << g << " M " << m;
        ASSERT_LE(b.one_step.total(), b.steady.total());
      }
    }
  }
}

// Note [What an update in backward cannot keep]: S - (H - 3F) each way, when
// the parameter chunks fit in H - 3F.
TEST(TrafficBound, UpdatesInBackwardMoveWhatTheHostLessThreeUpdatesCannotKeep) {
  StepState s{1200, 400, 500, false};
  EXPECT_FALSE(most_traffic_updating_in_backward(s)) << "the chunks not known";
  s.stored = 1400;
  s.parameters = 300;
  s.host = 450;
  s.largest_update = 50;
  const std::optional<Traffic> most = most_traffic_updating_in_backward(s);
  ASSERT_TRUE(most);
  EXPECT_EQ(most->read, 1100u);
  EXPECT_EQ(most->written, 1100u);
  EXPECT_GE(most->read, least_step_traffic(s).steady.read) << "never below the bound";
  s.parameters = 301;
  EXPECT_FALSE(most_traffic_updating_in_backward(s)) << "parameters that do not fit may be read twice";
  s.parameters = 100;
  s.largest_update = 200;
  EXPECT_FALSE(most_traffic_updating_in_backward(s)) << "three updates leave no room for them";
  s.host = 2000;
  EXPECT_EQ(most_traffic_updating_in_backward(s)->total(), 0u) << "everything stays on host";
}

TEST(TrafficBound, SecondsAtTheStoresBandwidth) {
  const Traffic t{2000000000, 1000000000};
  EXPECT_DOUBLE_EQ(t.seconds(2.0, 0.5), 1.0 + 2.0);
}

}  // namespace
}  // namespace strata::memory
