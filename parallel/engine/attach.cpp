// attach and detach: packing an unmodified module's parameters into chunk
// families, wiring the components, and giving the memory back.

#include <fmt/format.h>
#include <torch/torch.h>

#include <unordered_set>

#include "../zero/sharding.h"
#include "strata/parallel/lazy_init.h"
#include "strata/parallel/tensor_parallel.h"
#include "../dispatch/placement.h"
#include "engine_impl.h"
#include "family_stream.h"

namespace strata::parallel {

namespace {

// Non-model bytes where operators run: LibTorch's CPU allocator on the
// emulated device, the CUDA caching allocator on a GPU.
NonModelCounter& non_model_counter(const torch::Device& device) {
  if (device.is_cpu()) return cpu_non_model_counter();
  NonModelCounter* c = cuda_non_model_counter(device.index());
  STRATA_CHECK(c != nullptr, "tracing and device_capacity on CUDA read the CUDA caching allocator's statistics, "
               "but this LibTorch has no CUDA; build strata against a LibTorch with CUDA");
  return *c;
}

// A lazy tensor of `p`'s shape whose materialisation fails, saying why.
torch::Tensor released_placeholder(const ManagedParam& p) {
  torch::Tensor t;
  {
    LazyInit lazy;
    t = torch::empty(p.shape, torch::TensorOptions().dtype(torch::kFloat32));
  }
  defer_fill(t, [name = p.name](torch::Tensor&) {
    STRATA_FAIL("parameter ", name, " has no values: its module was constructed lazily, too large to be given back "
                "memory within the host budget, and its engine was destroyed; export_weights or save before destroying the engine, and load them "
                "into an engine to use them");
  });
  return t;
}

}  // namespace

Engine::Impl::Impl(torch::nn::Module& module, OptimizerConfig optimizer, EngineOptions options,
                   std::shared_ptr<Communicator> comm) {
  if (options.trace_path.empty()) options.take_trace_from_env();  // `strata trace record` on any program
  options.validate();
  optimizer.validate();
  ctx.comm = std::move(comm);
  if (!options.init_weights.empty()) import_weights(module, options);
  ctx.optimizer = std::move(optimizer);
  ctx.options = options;
  ctx.compute = scalar_type_of(options.precision);
  ctx.stage = ctx.data_parallel() ? options.zero_stage : 0;
  ctx.rank = ctx.comm ? ctx.comm->rank() : 0;
  STRATA_CHECK(!options.update_in_backward || !ctx.data_parallel(), "update_in_backward needs the gradients unreduced: "
               "here they are reduced over ", ctx.world(), " ranks (data parallelism, or sequence parallelism, whose "
               "ranks sum their gradients too), and a gradient is final only after its reduction, after backward; "
               "set update_in_backward false, or train with dp 1 and sp 1 (tensor and pipeline parallelism are fine)");
  STRATA_CHECK(!options.update_in_backward || options.clip_norm == 0 || options.pipeline_group == nullptr,
               "update_in_backward with clip_norm needs the whole model on one rank: a pipeline stage cannot know "
               "the other stages' part of the gradient norm while it runs backward; set clip_norm 0 (the updates "
               "in backward are then exact) or update_in_backward false");

  make_chunk_manager(ctx, residency.make_policy());

  // Trainable parameters, each once (tied weights appear under several names).
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const torch::Tensor& t = item.value();
    if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;
    if (!t.requires_grad()) {
      frozen.emplace_back(item.key(), t);  // stays in its own memory: Note [Module state on the compute device]
      continue;
    }
    STRATA_CHECK(t.scalar_type() == torch::kFloat32, "parameter ", item.key(), " is ", t.scalar_type(),
                 "; attach a module with fp32 parameters and choose the compute precision with "
                 "EngineOptions::precision (fp32, bf16 or fp16)");
    ManagedParam p;
    p.name = item.key();
    p.tensor = t;
    p.shape = t.sizes().vec();
    p.original_device = t.device();
    p.constructed_lazily = is_lazy(t);
    p.numel = t.numel();
    ctx.params.push_back(p);
  }
  STRATA_CHECK(!ctx.params.empty(), "the module has no trainable parameters");
  // Buffers and frozen parameters of a lazily constructed module keep memory of their own.
  for (const auto& [name, t] : frozen) materialize(t);
  for (const auto& b : module.buffers(/*recurse=*/true)) materialize(b);
  for (const auto& [name, t] : frozen) module_state.push_back({name, t, t.scalar_type(), t.device(), true});
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // a buffer shared by two modules
    module_state.push_back({item.key(), item.value(), item.value().scalar_type(), item.value().device()});
  }

  // Note [Clipping across the tensor group]: which parameters are slices, and of which group.
  for (ManagedParam& p : ctx.params) {
    p.whole_name = ctx.options.checkpoint_name ? ctx.options.checkpoint_name(p.name) : p.name;
    p.part = checkpoint::PartMap::whole(p.shape);
    Communicator* g = tensor_group_of(p.tensor);
    if (g == nullptr) continue;
    STRATA_CHECK(ctx.tensor_group == nullptr || ctx.tensor_group == g, "parameter ", p.name,
                 " is split over another tensor group than the module's other tensor-parallel layers; build every "
                 "layer of one module over the same group");
    ctx.tensor_group = g;
    p.copies = tensor_copies_of(p.tensor);
    // Note [Checkpoints across layouts]: a part whose layer did not say
    // where it lies (mark_split alone) is saved under a name of its tensor
    // rank's, which only the same layout loads.
    if (std::optional<checkpoint::PartMap> map = tensor_layout::part_map_of(p.tensor)) {
      STRATA_CHECK(map->part_elems() == p.numel, "parameter ", p.name, " holds ", p.numel, " elements, but its "
                   "layer's part map ", map->part_elems(), "; its data was replaced after the split");
      p.part = std::move(*map);
    } else {
      p.whole_name += fmt::format("@tensor{}of{}", g->rank(), g->world_size());
    }
  }
  STRATA_CHECK(ctx.tensor_group == nullptr || ctx.comm == nullptr || ctx.comm.get() != ctx.tensor_group,
               "attach's communicator is the tensor group its layers split parameters over; pass the data-parallel "
               "group (the mesh's data axis), or none");
  STRATA_CHECK(!options.update_in_backward || options.clip_norm == 0 || ctx.tensor_group == nullptr,
               "update_in_backward with clip_norm needs the whole model on one rank: a tensor-parallel rank cannot "
               "know the others' part of the gradient norm while it runs backward; set clip_norm 0 (the updates in "
               "backward are then exact) or update_in_backward false");
  assign_groups(ctx);
  tied = std::make_unique<TiedParameters>(ctx);  // Note [Tied parameters across stages]
  if (options.update_in_backward && !tied->empty()) {
    STRATA_LOG(kWarn, "update_in_backward: this stage holds a parameter tied to another pipeline stage (a head tied "
               "to the token embedding), whose gradient is summed with the other copies' after backward; every "
               "family's update waits for the step. Untie it to update in backward");
  }
  register_parameters(ctx);
  if (ctx.data_parallel()) check_same_layout_on_every_rank(ctx);  // before any collective pairs buffers

  if (ctx.data_parallel()) reducer = std::make_unique<GradientReducer>(ctx);
  if (reducer) {
    // Reductions in flight pin gradient chunks where the communicator reads
    // them: a pin that finds that tier full (an operator's, the next
    // reduction's) waits for the oldest. So does a pin on a faster tier
    // (Tier orders device < host < nvme): making room there evicts into the
    // communicator's tier, which may be full of those same gradients (a
    // parameter pinned on the device whose eviction victim has to go to a
    // host tier full of gradients being reduced). At stages 1 and 2 the
    // optimizer step's parameter all-gathers pin a family's parameter chunk
    // on host while the next family updates: a pin there waits for those
    // too. Only when nothing in flight is left to wait for does the pin fail,
    // at once, with the chunk manager's message naming the tier's budget.
    ctx.make_room = [this](Tier tier) {
      if (static_cast<int>(tier) > static_cast<int>(ctx.comm_tier())) return false;
      return reducer->settle_oldest() || (step_gathers != nullptr && step_gathers->settle_oldest());
    };
  }
  sink = std::make_unique<GradSink>(ctx, reducer.get());
  access = std::make_unique<ParamAccess>(ctx, *sink);
  if (ctx.stage == 1 || ctx.stage == 2) step_gathers = std::make_unique<StepGathers>(ctx);
  pipeline = std::make_unique<StepPipeline>(ctx, *sink, step_gathers.get());
  sink->set_arrival_hook([p = pipeline.get()](memory::FamilyId f, bool complete) { p->gradients_arrived(f, complete); });
  if (options.update_in_backward) {  // Note [Updates in backward]
    sink->set_settled_hook([p = pipeline.get()](size_t index) { p->gradient_settled(index); });
    // A pin that finds no room waits for the family the updater thread holds.
    ctx.make_room = [p = pipeline.get()](Tier) { return p->wait_for_an_update(); };
  }
  pipeline->place_optimizer_state();
  residency.hold_static_chunks();
  ctx.mgr->set_placement_listener(
      [this](const memory::Chunk& c, std::optional<Tier> tier, void* ptr) { residency.on_placed(c, tier, ptr); });

  move_parameters_into_chunks(ctx);
  torch::NoGradGuard no_grad;
  for (ModuleState& m : module_state) {  // Note [Module state on the compute device]
    const torch::Tensor placed = to_compute(ctx, m.tensor);
    if (!placed.is_same(m.tensor)) m.tensor.set_data(placed);
  }

  if (ctx.stage == 3) op_gathers = std::make_unique<OperatorGathers>(ctx);
  hook = std::make_unique<OpHook>(*this);
  if (!options.trace_path.empty()) recorder = std::make_unique<TraceRecorder>(ctx, non_model_counter(ctx.device));
  if (options.device_capacity > 0) residency.enable_capacity(non_model_counter(ctx.device));
  for (size_t i = 0; i < ctx.params.size(); ++i) hook->track(ctx.params[i].tensor, static_cast<int64_t>(i));
  sink->install();  // after set_data: a change of dtype gives the parameter a new accumulator
}

Engine::Impl::~Impl() {
  ctx.make_room = nullptr;  // the reducer goes before the context
  detach();
  if (ctx.mgr) ctx.mgr->set_placement_listener(nullptr);  // the residency goes before the manager
}

void Engine::Impl::detach() noexcept {
  try {
    if (access && poisoned.empty()) {
      std::lock_guard<std::mutex> lock(access_mu);
      access->absorb_replaced();  // data user code gave a parameter since the last step
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[strata error] parameter data given since the last step is lost: %s\n", e.what());
  }
  try {
    if (sink) sink->uninstall();
    if (hook) {
      for (size_t i = 0; i < ctx.params.size(); ++i) hook->untrack(static_cast<int64_t>(i));
    }
    // Note [Giving a model larger than memory back]: the engine still holds
    // its host tier while it gives parameters their memory back, so lazily
    // constructed parameters that would take the host memory in use past the
    // host budget are given back lazy instead, and reading one says why.
    uint64_t lazy_bytes = 0;
    for (const ManagedParam& p : ctx.params) lazy_bytes += p.constructed_lazily ? p.numel * sizeof(float) : 0;
    const uint64_t host_used = ctx.mgr->tier_stats(Tier::kHost).used;
    const bool too_large = lazy_bytes > 0 && lazy_bytes + host_used > ctx.options.budgets.host;
    if (too_large) {
      STRATA_LOG(kWarn, "the lazily constructed parameters ({}) do not fit beside the host tier's {} in the host budget "
                 "({}): the module gets them back without values; export_weights or save before the engine is "
                 "destroyed to keep them",
                 format_bytes(lazy_bytes), format_bytes(host_used), format_bytes(ctx.options.budgets.host));
    }
    torch::NoGradGuard no_grad;
    for (memory::FamilyId f : ctx.families) {  // one family's values at a time
      std::vector<float> data;
      for (ManagedParam& p : ctx.params) {
        if (p.family != f) continue;
        if (too_large && p.constructed_lazily) {
          p.tensor.set_data(released_placeholder(p));
          continue;
        }
        if (data.empty()) data = family_values(ctx, f);
        torch::Tensor owned = torch::from_blob(data.data() + p.offset, p.tensor.sizes(), torch::kFloat32)
                                  .clone()
                                  .to(p.original_device);
        p.tensor.set_data(owned);
      }
    }
    for (ModuleState& m : module_state) {
      const torch::Tensor back = m.tensor.to(m.original_device, m.original);
      if (!back.is_same(m.tensor)) m.tensor.set_data(back);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[strata error] could not give parameters their memory back: %s\n", e.what());
  }
}

}  // namespace strata::parallel
