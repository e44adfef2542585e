#include "strata/parallel/engine.h"

#include "engine_impl.h"
#include "strata/parallel/tensor_collectives.h"


namespace strata::parallel {

Engine::Engine(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options)
    : Engine(module, optimizer, std::move(options), nullptr) {}

Engine::Engine(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options,
               std::shared_ptr<Communicator> comm)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  options.validate();
  s.comm = std::move(comm);
  STRATA_CHECK(!s.data_parallel() || options.precision != DType::kBFloat16,
               "data parallel training reduces gradients with Gloo, which sums fp32 and fp16 but not bf16; "
               "use fp32 or fp16 with more than one rank");
  if (!options.init_weights.empty()) import_weights(module, options.init_weights);
  s.opt = optimizer;
  s.options = options;
  s.compute = scalar_type_of(options.precision);
  s.scale = options.precision == DType::kFloat16 ? options.loss_scale.initial : 1.0;
  s.stage = s.data_parallel() ? options.zero_stage : 0;
  s.rank = s.comm ? s.comm->rank() : 0;
  memory::ChunkManagerOptions mo;
  mo.budgets = options.budgets;
  mo.world_size = s.world();
  if (options.budgets.nvme > 0) {
    offload::NvmeStoreOptions no;
    no.directory = options.nvme_dir;
    no.capacity = options.budgets.nvme;
    mo.nvme = std::make_shared<memory::NvmeSwapStore>(no);
  }
  if (options.policy == "auto") {
    auto planner = std::make_unique<memory::TracePolicy>();
    s.planner = planner.get();
    mo.policy = std::move(planner);
  } else if (options.policy == "static") {
    auto placement = std::make_unique<memory::StaticPolicy>();
    s.placement = placement.get();
    mo.policy = std::move(placement);
  }
  s.mgr = std::make_unique<memory::ChunkManager>(std::move(mo));
  s.device = s.mgr->device().kind() == offload::DeviceKind::kCuda
                 ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(s.mgr->device().index()))
                 : torch::Device(torch::kCPU);

  // Trainable parameters, each once (tied weights appear under several names).
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<memory::TensorSpec> specs;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const torch::Tensor& t = item.value();
    if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;
    if (!t.requires_grad()) {
      s.frozen.emplace_back(item.key(), t);
      // Frozen: stays in its own memory, in the compute precision.
      if (t.is_floating_point() && t.scalar_type() != s.compute) s.casts.push_back({t, t.scalar_type()});
      continue;
    }
    STRATA_CHECK(t.scalar_type() == torch::kFloat32, "parameter ", item.key(), " is ", t.scalar_type(),
                 "; attach a module with fp32 parameters and choose the compute precision with "
                 "EngineOptions::precision (fp32, bf16 or fp16)");
    STRATA_CHECK(t.is_contiguous(), "parameter ", item.key(), " is not contiguous");
    Impl::Param p;
    p.name = item.key();
    p.tensor = t;
    p.original_device = t.device();
    p.numel = t.numel();
    s.params.push_back(p);
    specs.push_back({item.key(), t.numel()});
  }
  STRATA_CHECK(!s.params.empty(), "the module has no trainable parameters");
  for (const auto& b : module.buffers(/*recurse=*/true)) {
    if (b.is_floating_point() && b.scalar_type() != s.compute) s.casts.push_back({b, b.scalar_type()});
  }

  memory::FamilySpec spec;
  spec.param_dtype = options.precision;
  spec.optim_states = 2;
  spec.shard = memory::ShardSpec{s.rank, s.stage >= 1, s.stage >= 2, s.stage >= 3};
  memory::Registration reg;
  if (options.chunk_elems > 0) {
    reg = s.mgr->register_tensors(specs, spec, options.chunk_elems);
  } else {
    // Least padding in [64 Ki, 64 Mi] elements; the manager caps it at a quarter of the device budget.
    reg = s.mgr->register_tensors(specs, spec, memory::ChunkSizeSearch{1 << 16, 64 << 20, 1 << 14, 1});
  }
  s.families = reg.families;
  if (s.data_parallel()) s.check_same_layout_on_every_rank();  // before any collective pairs buffers
  s.place_optimizer_state();
  if (s.placement != nullptr) {
    std::vector<std::pair<ChunkId, uint64_t>> param_chunks;
    for (memory::FamilyId f : s.families) {
      const ChunkId c = s.mgr->family(f).param;
      param_chunks.emplace_back(c, s.mgr->chunk(c).alloc_bytes());
    }
    s.placement->set_held(memory::static_held_chunks(param_chunks, options.static_param_fraction, options.budgets.device));
  }
  for (size_t i = 0; i < s.params.size(); ++i) {
    Impl::Param& p = s.params[i];
    p.family = reg.tensors[i].family;
    p.slot = reg.tensors[i].slot;
    p.offset = reg.tensors[i].offset;
    s.params_of_chunk[s.mgr->family(p.family).param].push_back(i);
  }
  s.mgr->set_placement_listener(
      [&s](const memory::Chunk& c, std::optional<Tier> tier, void* ptr) { s.on_placed(c, tier, ptr); });

  // Copy each parameter into its slots (on host): the master in fp32, the
  // parameter chunk in the compute precision, each whole or this rank's
  // shard of it (Note [ZeRO over chunks]). Data parallel: rank 0's values,
  // broadcast first, so replicas start equal. Then give the tensor a storage
  // that follows the chunk; the original storage is released.
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> values;
  for (const Impl::Param& p : s.params) values.push_back(p.tensor.detach().to(torch::kCPU).contiguous());
  if (s.data_parallel()) {
    std::vector<WorkHandle> works;
    for (torch::Tensor& v : values) works.push_back(broadcast(*s.comm, v, 0));
    for (auto& w : works) w->wait();
    s.collectives += static_cast<int64_t>(works.size());
  }
  for (memory::FamilyId f : s.families) {
    const memory::ChunkFamily& fam = s.mgr->family(f);
    for (ChunkId c : fam.members()) {
      for (size_t slot = 0; slot < s.mgr->chunk(c).num_tensors(); ++slot) s.mgr->transition(c, slot, TensorState::kHold);
    }
  }
  const size_t esize = s.elem_size();
  for (size_t i = 0; i < s.params.size(); ++i) {
    Impl::Param& p = s.params[i];
    const memory::ChunkFamily& fam = s.mgr->family(p.family);
    const float* src = values[i].data_ptr<float>();
    const auto [begin, end] = s.owned(p);
    const auto copy_into = [&](ChunkId c, int64_t from, int64_t to, DType dtype) {
      if (from >= to) return;
      const std::vector<size_t> slots = s.mgr->chunk(c).shard() ? std::vector<size_t>{0} : std::vector<size_t>{p.slot};
      s.pin(c, Tier::kHost, slots);
      kernels::cast(src + (from - p.offset), DType::kFloat32, s.at(c, from), dtype, to - from);
      s.unpin(c, slots);
    };
    if (fam.param_shard) {
      copy_into(*fam.param_shard, begin, end, options.precision);  // the full chunk is gathered when used
    } else {
      copy_into(fam.param, p.offset, p.offset + p.numel, options.precision);
    }
    if (fam.master) copy_into(*fam.master, begin, end, DType::kFloat32);
    p.storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                      static_cast<size_t>(p.numel) * esize,
                                                      c10::DataPtr(nullptr, s.device), nullptr, false);
    torch::Tensor view = torch::empty({0}, torch::TensorOptions().dtype(s.compute).device(s.device))
                             .set_(c10::Storage(p.storage), 0, p.tensor.sizes(), p.tensor.strides());
    p.tensor.set_data(view);
  }
  for (Impl::Cast& c : s.casts) c.tensor.set_data(c.tensor.to(s.compute));
  if (s.data_parallel()) {
    for (size_t i = 0; i < s.families.size(); ++i) s.family_pos[s.families[i]] = i;
    s.grads_arrived.assign(s.families.size(), 0);
  }
  values.clear();
  if (s.stage == 3) {
    std::vector<int> all(static_cast<size_t>(s.world()));
    for (int r = 0; r < s.world(); ++r) all[r] = r;
    s.gather_comm = s.comm->split(all, "zero3-parameters");
  }
  s.hook = std::make_unique<OpHook>(s);
  if (!options.trace_path.empty()) s.start_trace();
  if (options.device_capacity > 0) s.nm_counter = s.non_model_counter();
  for (size_t i = 0; i < s.params.size(); ++i) {
    Impl::Param& p = s.params[i];
    s.hook->track(p.tensor, static_cast<int64_t>(i));
    // After set_data: a change of dtype gives the parameter a new accumulator.
    p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
    STRATA_CHECK(p.accumulator != nullptr, "parameter ", p.name, " has no gradient accumulator");
    Impl* self = &s;
    p.accumulator->add_pre_hook(
        std::make_unique<GradToChunk>([self, i](const torch::Tensor& grad) { self->accumulate_grad(i, grad); }));
  }
}

Engine::~Engine() {
  if (impl_) impl_->detach_all();
}

StepResult Engine::train_step(const std::function<torch::Tensor()>& loss_fn) {
  Impl& s = *impl_;
  STRATA_CHECK(s.poisoned.empty(), s.poisoned);
  StepResult r;
  r.loss_scale = s.scale;
  s.begin_traced_step();
  s.begin_plan_step();
  if (s.stage == 3) s.begin_gather_step();
  {
    OpHook::Scope scope(*s.hook);
    torch::Tensor loss = loss_fn();
    STRATA_CHECK(loss.defined() && loss.numel() == 1, "train_step's closure must return the loss as one number");
    r.loss = loss.item<double>();
    if (s.tracing()) s.recorder->phase = "backward";
    s.boundary = (s.micro_steps + 1) % s.options.grad_accumulation == 0;
    if (s.data_parallel() && s.boundary) s.begin_reductions();
    if (s.options.prefetch && (s.micro_steps + 1) % s.options.grad_accumulation == 0) s.read_optimizer_state_early();
    if (s.scale != 1.0) {
      (loss.to(torch::kFloat32) * s.scale).backward();
    } else {
      loss.backward();
    }
  }
  s.end_plan_step();
  if (s.stage == 3) {
    s.end_gather_step();
    s.release_gathered();
  }
  if (s.data_parallel() && s.boundary) s.finish_reductions();
  if (++s.micro_steps % s.options.grad_accumulation == 0) {
    if (s.tracing()) {
      s.recorder->phase = "optimizer";
      s.recorder->begin_op("strata::optimizer_step", {});
    }
    r.stepped = s.step(r.grad_norm);
    r.overflow = !r.stepped;
    if (s.tracing()) s.recorder->end_op(*s.mgr);
  }
  s.end_traced_step();
  return r;
}

torch::Tensor Engine::run(const std::function<torch::Tensor()>& fn) {
  if (impl_->planner != nullptr) impl_->planner->set_cursor(-1);  // not the planned sequence: LRU
  OpHook::Scope scope(*impl_->hook);
  torch::NoGradGuard no_grad;
  torch::Tensor out = fn().clone();  // owned: it must not alias a parameter chunk
  if (impl_->stage == 3) impl_->release_gathered();
  return out;
}

void Engine::zero_grad() {
  impl_->zero_grads();
  impl_->micro_steps = 0;
}

torch::ScalarType Engine::compute_dtype() const { return impl_->compute; }
double Engine::loss_scale() const { return impl_->scale; }
int64_t Engine::skipped_steps() const { return impl_->skipped; }
int64_t Engine::micro_steps() const { return impl_->micro_steps; }
int64_t Engine::replans() const { return impl_->replans; }
int64_t Engine::collectives() const { return impl_->collectives; }
int64_t Engine::parameter_gathers() const { return impl_->gathers; }
int64_t Engine::parameter_gathers_ahead() const { return impl_->gathers_ahead; }
int Engine::zero_stage() const { return impl_->stage; }
Engine::DataWait Engine::data_wait() const { return impl_->wait; }
uint64_t Engine::lowest_device_budget() const {
  return impl_->capacity_floor == UINT64_MAX ? impl_->options.budgets.device : impl_->capacity_floor;
}
memory::ChunkManager& Engine::chunks() { return *impl_->mgr; }
memory::TierStats Engine::tier_stats(memory::Tier tier) const { return impl_->mgr->tier_stats(tier); }
memory::MoveStats Engine::move_stats() const { return impl_->mgr->move_stats(); }
size_t Engine::num_families() const { return impl_->families.size(); }
size_t Engine::nvme_optim_families() const {
  return static_cast<size_t>(std::count(impl_->optim_on_nvme.begin(), impl_->optim_on_nvme.end(), true));
}

int64_t Engine::managed_parameters() const {
  int64_t n = 0;
  for (const auto& p : impl_->params) n += p.numel;
  return n;
}

int64_t Engine::model_state_bytes() const {
  return managed_parameters() * model_state_bytes_per_param(impl_->options.precision);
}

std::unique_ptr<Engine> attach(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options) {
  return std::make_unique<Engine>(module, optimizer, std::move(options));
}

std::unique_ptr<Engine> attach(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options,
                               std::shared_ptr<Communicator> comm) {
  return std::make_unique<Engine>(module, optimizer, std::move(options), std::move(comm));
}

}  // namespace strata::parallel
