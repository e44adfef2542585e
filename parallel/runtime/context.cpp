#include "context.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "strata/core/error.h"
#include "strata/core/log.h"
#include "strata/kernels/optim.h"
#include "strata/memory/nvme_swap_store.h"
#include "strata/parallel/lazy_init.h"
#include "strata/parallel/tensor_collectives.h"

namespace strata::parallel {

torch::ScalarType scalar_type_of(DType d) {
  switch (d) {
    case DType::kFloat32: return torch::kFloat32;
    case DType::kBFloat16: return torch::kBFloat16;
    case DType::kFloat16: return torch::kFloat16;
  }
  STRATA_FAIL("unknown dtype");
}

ChunkId EngineContext::step_param(memory::FamilyId f) const {
  const memory::ChunkFamily& fam = mgr->family(f);
  return fam.param_shard ? *fam.param_shard : fam.param;
}

ChunkId EngineContext::step_grad(memory::FamilyId f) const {
  const memory::ChunkFamily& fam = mgr->family(f);
  return fam.grad_shard ? *fam.grad_shard : fam.grad;
}

std::vector<ChunkId> EngineContext::optim_members(memory::FamilyId f) const {
  const memory::ChunkFamily& fam = mgr->family(f);
  std::vector<ChunkId> m = fam.optim_states;
  if (fam.master) m.push_back(*fam.master);
  return m;
}

std::vector<ChunkId> EngineContext::step_members(memory::FamilyId f) const {
  std::vector<ChunkId> m = optim_members(f);
  m.push_back(step_param(f));
  m.push_back(step_grad(f));
  return m;
}

int64_t EngineContext::origin(ChunkId c) const {
  const memory::Chunk& chunk = mgr->chunk(c);
  return chunk.shard() ? rank * mgr->family(chunk.family()).layout->shards.shard_elems : 0;
}

char* EngineContext::at(ChunkId c, int64_t elem) const {
  return static_cast<char*>(mgr->data(c)) + (elem - origin(c)) * dtype_size(mgr->chunk(c).dtype());
}

std::pair<int64_t, int64_t> EngineContext::owned(const ManagedParam& p) const {
  if (stage == 0) return {p.offset, p.offset + p.numel};
  return mgr->family(p.family).layout->slot_in_shard(p.slot, rank);
}

// Note [A pin races evictions]: access() makes the chunk resident and
// transition() pins it, each under the manager's lock but not together: a
// move on the copy engine (a read-ahead making room) may evict the chunk in
// between. The first slot's pin then fails (or holds it on another tier),
// changing nothing else, and the chunk is brought back and pinned again.
void EngineContext::pin(ChunkId chunk, Tier tier, const std::vector<size_t>& slots) {
  for (int attempt = 0;; ++attempt) {
    for (;;) {
      try {
        mgr->access(chunk, tier);
        break;
      } catch (const Error&) {
        if (!make_room || !make_room(tier)) throw;
      }
    }
    if (slots.empty()) return;
    const auto evicted = [&] { return mgr->chunk(chunk).location() != tier; };
    try {
      mgr->transition(chunk, slots[0], TensorState::kCompute);
    } catch (const Error&) {
      if (!evicted() || attempt >= 64) throw;
      continue;
    }
    if (!evicted()) break;
    mgr->transition(chunk, slots[0], TensorState::kHold);  // pinned where it was moved to: not where it is wanted
    STRATA_CHECK(attempt < 64, "chunk ", chunk, " left the ", memory::tier_name(tier), " tier 64 times before it could be pinned there");
  }
  size_t done = 1;
  try {
    for (; done < slots.size(); ++done) mgr->transition(chunk, slots[done], TensorState::kCompute);
  } catch (...) {
    for (size_t k = 0; k < done; ++k) mgr->transition(chunk, slots[k], TensorState::kHold);
    throw;
  }
}

void EngineContext::unpin(ChunkId chunk, const std::vector<size_t>& slots) {
  for (size_t s : slots) mgr->transition(chunk, s, TensorState::kHold);
}

std::vector<size_t> EngineContext::all_slots(ChunkId chunk) const {
  std::vector<size_t> s(mgr->chunk(chunk).num_tensors());
  for (size_t i = 0; i < s.size(); ++i) s[i] = i;
  return s;
}

void EngineContext::read_ahead(const std::vector<ChunkId>& chunks, std::vector<offload::CopyTicket>& tickets,
                               bool only_into_free) const {
  std::vector<ChunkId> wanted;
  uint64_t bytes = 0;
  for (ChunkId c : chunks) {
    const memory::Chunk& chunk = mgr->chunk(c);
    const auto where = chunk.location();
    if ((where && *where != Tier::kHost) || (!where && chunk.role() != memory::ChunkRole::kGrad)) {
      wanted.push_back(c);
      bytes += chunk.alloc_bytes();
    }
  }
  const memory::TierStats host = mgr->tier_stats(Tier::kHost);
  if (only_into_free && host.used + bytes > host.budget) return;
  for (ChunkId c : wanted) tickets.push_back(mgr->prefetch(c, Tier::kHost));
}

void EngineContext::settle(std::vector<offload::CopyTicket>& tickets) {
  for (auto& t : tickets) {
    try {
      offload::CopyEngine::wait(t);
    } catch (const std::exception& e) {
      STRATA_LOG(kDebug, "read-ahead failed, the access retried it: {}", e.what());
    }
  }
  tickets.clear();
}

}  // namespace strata::parallel

namespace strata::parallel {

torch::Tensor to_compute(const EngineContext& ctx, const torch::Tensor& t) {
  return t.to(ctx.device, t.is_floating_point() ? ctx.compute : t.scalar_type());
}

void make_chunk_manager(EngineContext& ctx, std::unique_ptr<memory::EvictionPolicy> policy) {
  const EngineOptions& options = ctx.options;
  memory::ChunkManagerOptions mo;
  mo.budgets = options.budgets;
  mo.world_size = ctx.world();
  if (options.budgets.nvme > 0) {
    offload::NvmeStoreOptions no;
    no.directory = options.nvme_dir;
    no.capacity = options.budgets.nvme;
    mo.nvme = std::make_shared<memory::NvmeSwapStore>(no);
  }
  mo.policy = std::move(policy);
  ctx.mgr = std::make_unique<memory::ChunkManager>(std::move(mo));
  ctx.device = ctx.mgr->device().kind() == offload::DeviceKind::kCuda
                   ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(ctx.mgr->device().index()))
                   : torch::Device(torch::kCPU);
}

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const int n = comm.world_size();
  const std::vector<double> sizes = all_gather_values(comm, {static_cast<double>(mine.size())});
  size_t most = 0;
  for (double v : sizes) most = std::max(most, static_cast<size_t>(v));
  const size_t words = (most + sizeof(float) - 1) / sizeof(float);
  std::vector<float> in(words), out(words * static_cast<size_t>(n));
  std::memcpy(in.data(), mine.data(), mine.size());
  comm.all_gather(in.data(), out.data(), words, DType::kFloat32)->wait();
  std::vector<std::string> all;
  for (int r = 0; r < n; ++r) {
    const char* at = reinterpret_cast<const char*>(out.data() + static_cast<size_t>(r) * words);
    all.emplace_back(at, static_cast<size_t>(sizes[r]));
  }
  return all;
}

void assign_groups(EngineContext& ctx) {
  const OptimizerConfig& o = ctx.optimizer;
  ctx.groups.clear();
  for (const ParamGroup& g : o.groups) {
    ctx.groups.push_back({g.name, g.lr.value_or(o.lr), g.weight_decay.value_or(o.weight_decay), g.beta1.value_or(o.beta1),
                          g.beta2.value_or(o.beta2), g.eps.value_or(o.eps), g.momentum.value_or(o.momentum)});
  }
  ctx.groups.push_back({"default", o.lr, o.weight_decay, o.beta1, o.beta2, o.eps, o.momentum});
  for (ManagedParam& p : ctx.params) {
    const std::vector<int64_t> shape(p.tensor.sizes().begin(), p.tensor.sizes().end());
    p.group = o.groups.size();
    for (size_t g = 0; g < o.groups.size(); ++g) {
      if (o.groups[g].select(p.name, shape)) {
        p.group = g;
        break;
      }
    }
  }
}

void register_parameters(EngineContext& ctx) {
  const EngineOptions& options = ctx.options;
  std::vector<memory::TensorSpec> specs;
  for (const ManagedParam& p : ctx.params) specs.push_back({p.name, p.numel});
  memory::FamilySpec spec;
  spec.param_dtype = options.precision;
  spec.optim_states = ctx.optimizer.state_count();
  spec.shard = memory::ShardSpec{ctx.rank, ctx.stage >= 1, ctx.stage >= 2, ctx.stage >= 3};
  memory::Registration reg;
  if (options.chunk_elems > 0) {
    reg = ctx.mgr->register_tensors(specs, spec, options.chunk_elems);
  } else {
    // Least padding in [64 Ki, 64 Mi] elements; the manager caps it at a quarter of the device budget.
    reg = ctx.mgr->register_tensors(specs, spec, memory::ChunkSizeSearch{1 << 16, 64 << 20, 1 << 14, 1});
  }
  ctx.families = reg.families;
  for (size_t i = 0; i < ctx.families.size(); ++i) ctx.family_pos[ctx.families[i]] = i;
  for (size_t i = 0; i < ctx.params.size(); ++i) {
    ManagedParam& p = ctx.params[i];
    p.family = reg.tensors[i].family;
    p.slot = reg.tensors[i].slot;
    p.offset = reg.tensors[i].offset;
    ctx.params_of_chunk[ctx.mgr->family(p.family).param].push_back(i);
  }
}

void move_parameters_into_chunks(EngineContext& ctx) {
  memory::ChunkManager& mgr = *ctx.mgr;
  torch::NoGradGuard no_grad;
  for (memory::FamilyId f : ctx.families) {
    for (ChunkId c : mgr.family(f).members()) {
      for (size_t slot = 0; slot < mgr.chunk(c).num_tensors(); ++slot) mgr.transition(c, slot, TensorState::kHold);
    }
  }
  const size_t esize = ctx.elem_size();
  // One parameter at a time, so a lazily constructed module (lazy_init.h)
  // never holds more than one parameter's values outside its chunks: the
  // host tier spills to NVMe as it fills. Data parallel, rank 0's values,
  // broadcast (the other ranks do not materialise theirs).
  for (size_t i = 0; i < ctx.params.size(); ++i) {
    ManagedParam& p = ctx.params[i];
    torch::Tensor value;
    if (!is_lazy(p.tensor)) {
      value = p.tensor.detach().to(torch::kCPU).contiguous();
    } else if (ctx.rank == 0 || !ctx.data_parallel()) {
      value = materialized_copy(p.tensor).contiguous();
    } else {
      value = torch::empty(p.tensor.sizes(), torch::kFloat32);
    }
    if (ctx.data_parallel()) {
      broadcast(*ctx.comm, value, 0)->wait();
      ++ctx.collectives;
    }
    const memory::ChunkFamily& fam = mgr.family(p.family);
    const float* src = value.data_ptr<float>();
    const auto [begin, end] = ctx.owned(p);
    const auto copy_into = [&](ChunkId c, int64_t from, int64_t to, DType dtype) {
      if (from >= to) return;
      const std::vector<size_t> slots = mgr.chunk(c).shard() ? std::vector<size_t>{0} : std::vector<size_t>{p.slot};
      ctx.pin(c, Tier::kHost, slots);
      kernels::cast(src + (from - p.offset), DType::kFloat32, ctx.at(c, from), dtype, to - from);
      ctx.unpin(c, slots);
    };
    if (fam.param_shard) {
      copy_into(*fam.param_shard, begin, end, ctx.options.precision);  // the full chunk is gathered when used
    } else {
      copy_into(fam.param, p.offset, p.offset + p.numel, ctx.options.precision);
    }
    if (fam.master) copy_into(*fam.master, begin, end, DType::kFloat32);
    value = torch::Tensor();
    // Where the placement listener would point it (Residency::on_placed).
    void* slot = ctx.addressable(mgr.chunk(fam.param).location()) ? ctx.at(fam.param, p.offset) : nullptr;
    p.storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                      static_cast<size_t>(p.numel) * esize,
                                                      c10::DataPtr(slot, ctx.device), nullptr, false);
    // Row-major, as `value` was copied: a parameter attached with other strides
    // (a transposed tensor) keeps its shape and values, and becomes contiguous.
    torch::Tensor view = torch::empty({0}, torch::TensorOptions().dtype(ctx.compute).device(ctx.device))
                             .set_(c10::Storage(p.storage), 0, p.tensor.sizes());
    p.tensor.set_data(view);
  }
}

// Note [Weights across tensor ranks]
// Each rank of a tensor group holds other parts of the split parameters, so
// export_weights writes one file per tensor rank (with data parallelism, the
// data group's rank 0 of each). Checkpoints are one directory for every
// layout instead (Note [Checkpoints across layouts] in checkpoint_format.h).
std::string EngineContext::tensor_part_file(const std::string& path) const {
  if (tensor_group == nullptr || tensor_group->world_size() == 1) return path;
  const std::filesystem::path p(path);
  return (p.parent_path() / fmt::format("{}.tensor-{}-of-{}{}", p.stem().string(), tensor_group->rank(),
                                        tensor_group->world_size(), p.extension().string()))
      .string();
}

}  // namespace strata::parallel
