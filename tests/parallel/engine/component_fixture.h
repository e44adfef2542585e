#pragma once
// A context built the way attach builds it (a real chunk manager, real
// parameters packed into chunk families and given storages that follow their
// chunks), for the engine components' own unit tests.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "runtime/context.h"
#include "engine/residency.h"
#include "strata/parallel/memory_counter.h"

namespace strata::parallel {

/// Chunk payloads are 4 KiB aligned: 1024 fp32 elements fill one exactly.
constexpr int64_t kChunkElems = 1024;
constexpr uint64_t kChunkBytes = 4096;

inline EngineOptions component_options(uint64_t device_chunks, const std::string& policy = "lru") {
  EngineOptions o;
  o.budgets.device = device_chunks * kChunkBytes;
  o.budgets.host = 64 << 20;
  o.chunk_elems = kChunkElems;
  o.policy = policy;
  return o;
}

class ComponentContext {
 public:
  /// One trainable parameter of `sizes[i]` elements each, random values from
  /// `seed` (the same on every thread). With `comm` of more than one rank: data parallel at ZeRO
  /// `options.zero_stage`, rank 0's values broadcast, as attach does.
  ComponentContext(EngineOptions options, const std::vector<int64_t>& sizes, uint64_t seed = 1,
                   std::shared_ptr<Communicator> comm = nullptr) {
    ctx.options = options;
    if (comm != nullptr && comm->world_size() > 1) {
      ctx.comm = std::move(comm);
      ctx.stage = options.zero_stage;
      ctx.rank = ctx.comm->rank();
    }
    ctx.compute = scalar_type_of(options.precision);
    make_chunk_manager(ctx, residency.make_policy());
    // A generator of its own: contexts built on several threads (ranks) draw the same values.
    at::Generator gen = at::detail::createCPUGenerator(seed);
    for (size_t i = 0; i < sizes.size(); ++i) {
      ManagedParam p;
      p.name = "p" + std::to_string(i);
      p.tensor = torch::randn({sizes[i]}, gen).requires_grad_();
      p.numel = sizes[i];
      initial.push_back(p.tensor.detach().clone());
      ctx.params.push_back(p);
    }
    assign_groups(ctx);
    register_parameters(ctx);
    residency.hold_static_chunks();
    ctx.mgr->set_placement_listener(
        [this](const memory::Chunk& c, std::optional<Tier> tier, void* ptr) { residency.on_placed(c, tier, ptr); });
    move_parameters_into_chunks(ctx);
  }
  ~ComponentContext() { ctx.mgr->set_placement_listener(nullptr); }
  ComponentContext(const ComponentContext&) = delete;
  ComponentContext& operator=(const ComponentContext&) = delete;

  ChunkId chunk_of(size_t param) const { return ctx.param_chunk(ctx.params[param]); }
  /// Parameter `param`'s fp32 values as the chunks hold them now (on host).
  torch::Tensor values(size_t param) {
    const ManagedParam& p = ctx.params[param];
    const ChunkId c = ctx.mgr->family(p.family).master ? *ctx.mgr->family(p.family).master : ctx.step_param(p.family);
    std::vector<float> out(static_cast<size_t>(p.numel));
    ctx.with_on_host({c}, [&] { std::memcpy(out.data(), ctx.at(c, p.offset), out.size() * sizeof(float)); });
    return torch::from_blob(out.data(), {p.numel}, torch::kFloat32).clone();
  }
  /// Parameter `param`'s slot of its gradient chunk, in fp32.
  torch::Tensor grad(size_t param) {
    const ManagedParam& p = ctx.params[param];
    const ChunkId gc = ctx.mgr->family(p.family).grad;
    torch::Tensor out;
    ctx.with_on_host({gc}, [&] {
      out = torch::from_blob(ctx.at(gc, p.offset), {p.numel}, ctx.compute).to(torch::kFloat32).clone();
    });
    return out;
  }

  EngineContext ctx;
  Residency residency{ctx};
  std::vector<torch::Tensor> initial;
};

/// Non-model bytes the test sets: the device-capacity rule and the tracer read them.
class FixedCounter final : public NonModelCounter {
 public:
  const char* source() const override { return "test"; }
  uint64_t current() override { return live; }
  uint64_t peak() override { return live; }
  void reset_peak() override {}
  uint64_t interval_peak() override { return live; }
  void reset_interval_peak() override {}
  uint64_t live = 0;
};

}  // namespace strata::parallel
