// ZeRO's components on their own (parallel/zero/): two Gloo ranks on
// loopback, each a thread of this process with its own chunk manager and
// parameters packed as attach packs them.
// - GradientReducer: every family's gradient summed over the ranks at
//   stages 0-3 (all-reduce, or reduce-scatter into the rank's shard; the
//   step divides by the ranks and micro-steps), when the ranks' gradients
//   arrive in different orders (Note [Data parallel gradients]: reductions
//   pair by family, never by arrival), and for a parameter only one rank
//   used (zeros from the other, every rank updates it).
// - StepGathers: the parameter chunk all-gathered from every rank's shard.
// - OperatorGathers: ranks wanting different chunks agree on one sequence
//   of gathers (Note [Gathers agreed in rounds]) and each gets the whole chunk.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "component_fixture.h"
#include "engine/grad_sink.h"
#include "port_hold.h"
#include "zero/gathers.h"
#include "zero/reducer.h"

namespace strata::parallel {
namespace {

constexpr int kWorld = 2;

// Runs fn(rank, communicator) on kWorld ranks, one thread each; a rank's
// failure (an exception, a failed expectation's throw) fails the test.
void on_ranks(const std::function<void(int, std::shared_ptr<Communicator>)>& fn) {
  const tools::PortHold port;  // held until both ranks are done (Note [A port held for the job])
  std::vector<std::exception_ptr> errors(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      try {
        Rendezvous rv;
        rv.rank = r;
        rv.world_size = kWorld;
        rv.local_rank = r;
        rv.local_world_size = kWorld;
        rv.master_port = port.port();
        CommunicatorOptions co;
        co.timeout = std::chrono::seconds(30);
        fn(r, make_gloo_communicator(rv, co));
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kWorld; ++r) {
    if (!errors[static_cast<size_t>(r)]) continue;
    try {
      std::rethrow_exception(errors[static_cast<size_t>(r)]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << ": " << e.what();
    }
  }
}

// Parameter i's gradient on rank r: distinct per rank, parameter and element.
torch::Tensor gradient(int r, size_t i, int64_t n) {
  return torch::arange(n, torch::kFloat32) * 0.001f + static_cast<float>(i) + 10.0f * static_cast<float>(r + 1);
}

// Four single-chunk families of equal size, so a reduction paired with
// another family's would go through without an error, only wrong.
const std::vector<int64_t> kSizes = {kChunkElems, kChunkElems, kChunkElems, kChunkElems};

TEST(ZeroReducer, SumsEveryFamilyWhateverOrderTheGradientsArriveIn) {
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    on_ranks([&](int rank, std::shared_ptr<Communicator> comm) {
      EngineOptions o = component_options(8);
      o.zero_stage = stage;
      ComponentContext t(o, kSizes, 3, comm);
      ASSERT_EQ(t.ctx.stage, stage);
      ASSERT_EQ(t.ctx.families.size(), kSizes.size());
      GradientReducer reducer(t.ctx);
      GradSink sink(t.ctx, &reducer);
      reducer.begin();
      // Rank 0 delivers in backward order (the last family first), rank 1 in forward order.
      for (size_t k = 0; k < kSizes.size(); ++k) {
        const size_t i = rank == 0 ? kSizes.size() - 1 - k : k;
        sink.accumulate(i, gradient(rank, i, kSizes[i]));
      }
      reducer.finish();
      for (size_t i = 0; i < kSizes.size(); ++i) {
        const ManagedParam& p = t.ctx.params[i];
        EXPECT_TRUE(p.has_grad);
        const auto [begin, end] = t.ctx.owned(p);
        ASSERT_LT(begin, end);
        const torch::Tensor sum = gradient(0, i, p.numel) + gradient(1, i, p.numel);
        const ChunkId g = t.ctx.step_grad(p.family);
        std::vector<float> got(static_cast<size_t>(end - begin));
        t.ctx.with_on_host({g}, [&] { std::memcpy(got.data(), t.ctx.at(g, begin), got.size() * sizeof(float)); });
        const torch::Tensor expected = sum.slice(0, begin - p.offset, end - p.offset);
        EXPECT_TRUE(torch::allclose(torch::from_blob(got.data(), {end - begin}), expected, 1e-6, 1e-6))
            << "rank " << rank << ", parameter " << i << ": not the sum of both ranks' gradients";
        if (stage >= 2) {
          EXPECT_LT(end - begin, p.numel) << "a reduce-scatter leaves each rank its shard only";
        }
      }
    });
  }
}

TEST(ZeroReducer, AParameterOneRankUsedIsReducedWithZerosAndUpdatedEverywhere) {
  on_ranks([&](int rank, std::shared_ptr<Communicator> comm) {
    ComponentContext t(component_options(8), kSizes, 3, comm);
    GradientReducer reducer(t.ctx);
    GradSink sink(t.ctx, &reducer);
    reducer.begin();
    for (size_t i = 0; i < kSizes.size(); ++i) {
      if (i == 1 && rank == 1) continue;  // rank 1 took the other branch
      sink.accumulate(i, gradient(rank, i, kSizes[i]));
    }
    reducer.finish();
    EXPECT_TRUE(t.ctx.params[1].has_grad) << "rank " << rank << " must update what any rank used";
    EXPECT_TRUE(torch::allclose(t.grad(1), gradient(0, 1, kSizes[1]), 1e-6, 1e-6)) << "rank " << rank;
  });
}

TEST(ZeroGathers, StepGathersRebuildTheParameterChunkFromEveryShard) {
  on_ranks([&](int rank, std::shared_ptr<Communicator> comm) {
    EngineOptions o = component_options(8);
    o.zero_stage = 1;
    ComponentContext t(o, kSizes, 5, comm);
    // Each rank "updates" its shard of every parameter: value = rank + 1.
    for (const ManagedParam& p : t.ctx.params) {
      const auto [begin, end] = t.ctx.owned(p);
      const ChunkId c = t.ctx.step_param(p.family);
      t.ctx.with_on_host({c}, [&] {
        float* v = reinterpret_cast<float*>(t.ctx.at(c, begin));
        for (int64_t k = 0; k < end - begin; ++k) v[k] = static_cast<float>(rank + 1);
      });
    }
    StepGathers gathers(t.ctx);
    for (memory::FamilyId f : t.ctx.families) gathers.start(f);
    gathers.finish(0);
    for (size_t i = 0; i < t.ctx.params.size(); ++i) {
      const ManagedParam& p = t.ctx.params[i];
      const torch::Tensor v = t.values(i);
      const auto [begin, end] = t.ctx.owned(p);
      // This rank's part holds its own value, the rest the other rank's.
      for (int64_t k = 0; k < p.numel; ++k) {
        const bool mine = p.offset + k >= begin && p.offset + k < end;
        const float want = static_cast<float>(mine ? rank + 1 : 2 - rank);
        ASSERT_EQ(v[k].item<float>(), want) << "rank " << rank << ", parameter " << i << ", element " << k;
      }
    }
  });
}

TEST(ZeroGathers, RanksWantingDifferentChunksAgreeAndEachGetsTheWholeChunk) {
  on_ranks([&](int rank, std::shared_ptr<Communicator> comm) {
    EngineOptions o = component_options(8);
    o.zero_stage = 3;
    ComponentContext t(o, kSizes, 7, comm);
    OperatorGathers gathers(t.ctx);
    // Rank 0 runs operators on parameters 0 then 2; rank 1 only on 3 (another branch).
    const std::vector<size_t> mine = rank == 0 ? std::vector<size_t>{0, 2} : std::vector<size_t>{3};
    for (size_t i : mine) {
      const ChunkId c = t.chunk_of(i);
      gathers.before_operator({c}, /*in_step=*/false);
      // The full parameter chunk is on the device tier, every element as broadcast from rank 0 at attach.
      std::vector<float> got(static_cast<size_t>(kSizes[i]));
      t.ctx.mgr->read(c, got.data(), got.size() * sizeof(float));
      EXPECT_TRUE(torch::equal(torch::from_blob(got.data(), {kSizes[i]}), t.initial[i]))
          << "rank " << rank << ", parameter " << i << ": the gathered chunk is not the whole parameter";
    }
    gathers.finish_rounds();
    gathers.release_all();
    EXPECT_EQ(gathers.gathers(), rank == 0 ? 2 : 1) << "the gathers of the chunks this rank wanted";
    EXPECT_EQ(gathers.served(), rank == 0 ? 1 : 2) << "and of those only the other rank wanted: the union, on both";
  });
}

}  // namespace
}  // namespace strata::parallel
