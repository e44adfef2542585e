// Pipeline schedules as data (simulated), balanced partitioning, and the
// zero-bubble split backward against LibTorch's full backward.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>
#include <tuple>

#include "pipeline/split_backward.h"
#include "strata/core/error.h"
#include "strata/parallel/pipeline_schedule.h"

namespace pp = strata::parallel::pipeline;
using pp::ActionKind;
using pp::Schedule;

namespace {

std::vector<std::vector<pp::Action>> all_ranks(Schedule s, int p, int v, int m) {
  std::vector<std::vector<pp::Action>> out;
  for (int r = 0; r < p; ++r) out.push_back(pp::schedule_actions(s, r, p, v, m));
  return out;
}

}  // namespace

TEST(PipelineSchedule, EveryScheduleRunsEachPassOnceAndCompletes) {
  for (Schedule s : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B, Schedule::kZeroBubbleH1}) {
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 9; ++m) {
        const int v = s == Schedule::kInterleaved1F1B ? 2 : 1;
        if (s == Schedule::kInterleaved1F1B && m % p != 0) continue;
        const auto ranks = all_ranks(s, p, v, m);
        std::set<std::tuple<int, int, int>> seen;
        for (int r = 0; r < p; ++r) {
          for (const pp::Action& a : ranks[r]) {
            EXPECT_EQ(a.stage % p, r) << pp::schedule_name(s) << " gives rank " << r << " stage " << a.stage;
            EXPECT_TRUE(seen.insert({static_cast<int>(a.kind), a.stage, a.microbatch}).second)
                << pp::schedule_name(s) << " runs " << pp::to_string(a) << " twice";
          }
        }
        const size_t per_pass = static_cast<size_t>(p) * v * m;
        EXPECT_EQ(seen.size(), per_pass * (s == Schedule::kZeroBubbleH1 ? 3 : 2)) << pp::schedule_name(s);
        const pp::SimulatedStep sim = pp::simulate(ranks, p, v, {});
        EXPECT_TRUE(sim.completes) << pp::schedule_name(s) << " p=" << p << " m=" << m << ": " << sim.stuck;
      }
    }
  }
}

TEST(PipelineSchedule, BubblesMatchTheFormulasAndOneFOneBBoundsMemory) {
  const int p = 4, m = 8;
  // Full B = BI + W; equal F, BI and W.
  for (Schedule s : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B, Schedule::kZeroBubbleH1}) {
    const int v = s == Schedule::kInterleaved1F1B ? 2 : 1;
    pp::ActionCosts c;
    c.forward = c.backward_input = c.backward_weight = 1.0 / v;  // a chunk is 1/v of a stage
    const pp::SimulatedStep sim = pp::simulate(all_ranks(s, p, v, m), p, v, c);
    ASSERT_TRUE(sim.completes);
    EXPECT_NEAR(sim.bubble(), pp::bubble_formula(s, p, v, m, c), 1e-9) << pp::schedule_name(s);
    for (int r = 0; r < p; ++r) {
      if (s == Schedule::kGPipe) {
        EXPECT_EQ(sim.peak_in_flight[r], m);
      } else if (s == Schedule::k1F1B) {
        EXPECT_EQ(sim.peak_in_flight[r], p - r);
      } else if (s == Schedule::kZeroBubbleH1) {
        EXPECT_LE(sim.peak_in_flight[r], p);
      }
    }
  }
  // ZB-H1's bubble is a third of 1F1B's with equal passes.
  pp::ActionCosts c;
  const double zb = pp::simulate(all_ranks(Schedule::kZeroBubbleH1, p, 1, m), p, 1, c).bubble();
  const double one = pp::simulate(all_ranks(Schedule::k1F1B, p, 1, m), p, 1, c).bubble();
  EXPECT_LT(zb, one * 0.5);
}

TEST(PipelineSchedule, OrdersThatWouldHangAreCaught) {
  // Two ranks whose second stage runs its backwards in the other order.
  auto ranks = all_ranks(Schedule::kGPipe, 2, 1, 2);
  std::swap(ranks[1][2], ranks[1][3]);
  const pp::SimulatedStep sim = pp::simulate(ranks, 2, 1, {});
  EXPECT_FALSE(sim.completes);
  EXPECT_NE(sim.stuck.find("another order"), std::string::npos) << sim.stuck;
}

TEST(PipelineSchedule, BadInputIsAClearError) {
  EXPECT_THROW(pp::schedule_from_name("1F1B-typo"), strata::Error);
  EXPECT_THROW(pp::check_schedule(Schedule::kInterleaved1F1B, 4, 2, 6), strata::Error);
  EXPECT_THROW(pp::check_schedule(Schedule::k1F1B, 2, 2, 4), strata::Error);
  EXPECT_THROW(pp::check_schedule(Schedule::kGPipe, 2, 1, 0), strata::Error);
  try {
    pp::partition_balanced({1, 1}, 3);
    FAIL() << "two layers cut into three stages";
  } catch (const strata::Error& e) {
    EXPECT_NE(std::string(e.what()).find("fewer than the 3 stages"), std::string::npos) << e.what();
  }
}

TEST(PipelineSchedule, PartitionBalancesTheLargestStage) {
  EXPECT_EQ(pp::partition_balanced({1, 1, 1, 1}, 2), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(pp::partition_balanced({5, 1, 1, 1, 1, 1}, 2), (std::vector<int>{0, 1, 6}));
  EXPECT_EQ(pp::partition_balanced({1, 2, 3, 4, 5, 6}, 3), (std::vector<int>{0, 3, 5, 6}));
  EXPECT_EQ(pp::partition_balanced({0, 0, 0}, 3), (std::vector<int>{0, 1, 2, 3}));
}

namespace {

// Counts its backward calls: in the middle of the input chain.
struct CountingIdentity : torch::autograd::Function<CountingIdentity> {
  static int calls;
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    calls += 1;
    return {g[0]};
  }
};
int CountingIdentity::calls = 0;

struct Stage : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  Stage() {
    torch::manual_seed(3);
    a = register_module("a", torch::nn::Linear(8, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    b = register_module("b", torch::nn::Linear(16, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = torch::tanh(norm->forward(a->forward(x)));
    h = CountingIdentity::apply(h);
    return b->forward(h) + torch::matmul(h, a->weight.narrow(1, 0, 8));  // a's weight used twice
  }
};

}  // namespace

TEST(SplitBackward, InputThenWeightPassEqualsTheFullBackward) {
  torch::manual_seed(0);
  const torch::Tensor x0 = torch::randn({5, 8}), g = torch::randn({5, 8});
  // Full backward.
  Stage full;
  torch::Tensor x = x0.clone().requires_grad_(true);
  torch::autograd::backward({full.forward(x)}, {g});
  // Split.
  Stage split;
  torch::Tensor xs = x0.clone().requires_grad_(true);
  torch::Tensor y = split.forward(xs);
  CountingIdentity::calls = 0;
  pp::SplitBackward sb;
  const std::vector<torch::Tensor> gxs = sb.input_pass({y}, {g}, {xs});
  ASSERT_EQ(gxs.size(), 1u);
  const torch::Tensor gx = gxs[0];
  EXPECT_EQ(CountingIdentity::calls, 1);
  for (const auto& p : split.parameters()) EXPECT_FALSE(p.grad().defined()) << "the input pass computed a weight gradient";
  ASSERT_TRUE(gx.defined());
  EXPECT_TRUE(torch::allclose(gx, x.grad(), 1e-6, 1e-6));
  sb.weight_pass();
  EXPECT_EQ(CountingIdentity::calls, 1) << "the weight pass walked the input chain again";
  EXPECT_FALSE(xs.grad().defined());
  auto want = full.named_parameters();
  for (const auto& item : split.named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_TRUE(torch::allclose(item.value().grad(), want[item.key()].grad(), 1e-6, 1e-6)) << item.key();
  }
}

TEST(SplitBackward, AFirstStageDefersItsWholeBackward) {
  Stage full, split;
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({3, 8}), g = torch::randn({3, 8});
  torch::autograd::backward({full.forward(x)}, {g});
  torch::Tensor y = split.forward(x);
  pp::SplitBackward sb;
  EXPECT_FALSE(sb.input_pass({y}, {g}, {x}).at(0).defined());
  for (const auto& p : split.parameters()) EXPECT_FALSE(p.grad().defined());
  sb.weight_pass();
  auto want = full.named_parameters();
  for (const auto& item : split.named_parameters()) {
    EXPECT_TRUE(torch::allclose(item.value().grad(), want[item.key()].grad(), 1e-6, 1e-6)) << item.key();
  }
}

// A stage of two inputs and three outputs (Note [Tuples between stages]):
// one output from both inputs, one from the second alone, one from neither
// (a parameter's own function), and an integer input with no gradient.
TEST(SplitBackward, SeveralInputsAndOutputsEqualTheFullBackward) {
  torch::manual_seed(2);
  const torch::Tensor x0 = torch::randn({4, 8}), z0 = torch::randn({4, 8});
  const torch::Tensor g1 = torch::randn({4, 8}), g2 = torch::randn({4, 8}), g3 = torch::randn({8, 8});
  const torch::Tensor ids = torch::randint(0, 4, {4});
  struct Two {
    torch::nn::Linear a{8, 8}, b{8, 8};
    std::vector<torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& z, const torch::Tensor& i) {
      const torch::Tensor picked = z.index_select(0, i);
      return {torch::tanh(a->forward(x)) * b->forward(z), b->forward(picked), a->weight * 2.0};
    }
    std::vector<torch::Tensor> params() { return {a->weight, a->bias, b->weight, b->bias}; }
  };
  torch::manual_seed(3);
  Two full;
  torch::manual_seed(3);
  Two split;
  torch::Tensor x = x0.clone().requires_grad_(true), z = z0.clone().requires_grad_(true);
  const std::vector<torch::Tensor> yf = full.forward(x, z, ids);
  torch::autograd::backward(yf, {g1, g2, g3});
  torch::Tensor xs = x0.clone().requires_grad_(true), zs = z0.clone().requires_grad_(true);
  const std::vector<torch::Tensor> ys = split.forward(xs, zs, ids);
  pp::SplitBackward sb;
  const std::vector<torch::Tensor> gx = sb.input_pass(ys, {g1, g2, g3}, {xs, zs, ids});
  ASSERT_EQ(gx.size(), 3u);
  EXPECT_FALSE(gx[2].defined()) << "an integer input got a gradient";
  ASSERT_TRUE(gx[0].defined() && gx[1].defined());
  EXPECT_TRUE(torch::allclose(gx[0], x.grad(), 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(gx[1], z.grad(), 1e-6, 1e-6));
  for (const torch::Tensor& p : split.params()) EXPECT_FALSE(p.grad().defined()) << "the input pass computed a weight gradient";
  sb.weight_pass();
  const std::vector<torch::Tensor> want = full.params(), got = split.params();
  for (size_t k = 0; k < want.size(); ++k) {
    ASSERT_TRUE(got[k].grad().defined()) << "parameter " << k;
    EXPECT_TRUE(torch::allclose(got[k].grad(), want[k].grad(), 1e-6, 1e-6)) << "parameter " << k;
  }
}

#include <filesystem>
#include <unistd.h>

#include "strata/parallel/engine.h"

TEST(PipelinePartition, CostsPerLayerComeFromARecordedTrace) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("strata-pp-trace-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "trace.json").string();
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(32, 32), torch::nn::Linear(32, 1024), torch::nn::Linear(1024, 1024),
                              torch::nn::Linear(1024, 32));
  strata::parallel::EngineOptions o;
  o.budgets = {64ull << 20, 128ull << 20, 0};
  o.trace_path = path;
  o.trace_steps = 2;
  {
    auto engine = strata::parallel::attach(*model, strata::parallel::AdamWConfig{}, o);
    for (int s = 0; s < 2; ++s) {
      const torch::Tensor x = torch::randn({256, 32});
      engine->train_step([&] { return model->forward(x).pow(2).mean(); });
    }
  }
  const pp::LayerCosts c = pp::trace_layer_costs(path, 4);
  ASSERT_EQ(c.seconds.size(), 4u);
  // The 1024 x 1024 layer does 32 times the first's work, and its output is 32 times wider.
  EXPECT_GT(c.seconds[2], c.seconds[0]);
  EXPECT_GT(c.activation_bytes[2], 4 * c.activation_bytes[0]);
  EXPECT_GT(c.activation_bytes[1], 4 * c.activation_bytes[0]);
  const std::vector<double> mixed = pp::mixed_costs(c, 0.5);
  double sum = 0;
  for (double v : mixed) sum += v;
  EXPECT_NEAR(sum, 1.0, 1e-9);
  const std::vector<int> bounds = pp::partition_balanced(mixed, 2);
  EXPECT_EQ(bounds.front(), 0);
  EXPECT_EQ(bounds.back(), 4);
  // A model with fewer layers than the trace names: a clear error.
  EXPECT_THROW(pp::trace_layer_costs(path, 2), strata::Error);
  fs::remove_all(dir);
}
