#include "strata/parallel/engine.h"

#include <c10/core/StorageImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/memory/nvme_swap_store.h"
#include "strata/parallel/op_hook.h"

namespace strata::parallel {

using memory::ChunkId;
using memory::Tier;
using memory::TensorState;

// Note [Parameter storages follow their chunk]
// At attach every trainable parameter gets a StorageImpl of its own with a
// non-owning DataPtr; the original storage is released (attaching does not
// double memory). The chunk manager's placement listener sets that DataPtr to
// the parameter's slot whenever its chunk lands on the device tier and to null
// when it leaves. Because the StorageImpl object never changes, every view of
// the parameter, including the views autograd saved for backward (linear
// saves weight.t()), follows the chunk too: the hook sees them in backward by
// their storage and makes the chunk resident before the operator reads them.
struct Engine::Impl : OpObserver {
  struct Param {
    std::string name;
    torch::Tensor tensor;
    c10::intrusive_ptr<c10::StorageImpl> storage;
    torch::Device original_device{torch::kCPU};
    memory::FamilyId family = 0;
    size_t slot = 0;
    int64_t offset = 0;
    int64_t numel = 0;
    int64_t steps = 0;
    bool has_grad = false;
  };

  AdamWConfig opt;
  EngineOptions options;
  std::unique_ptr<memory::ChunkManager> mgr;
  std::vector<Param> params;
  std::unordered_map<ChunkId, std::vector<size_t>> params_of_chunk;  // param chunks only
  std::vector<memory::FamilyId> families;
  std::unique_ptr<OpHook> hook;
  torch::Device device{torch::kCPU};
  int micro_steps = 0;
  std::mutex grad_mu;

  ChunkId param_chunk(const Param& p) const { return mgr->family(p.family).param; }

  // See Note [Parameter storages follow their chunk]. Runs under the manager's lock.
  void on_placed(const memory::Chunk& c, std::optional<Tier> tier, void* ptr) {
    const auto it = params_of_chunk.find(c.id());
    if (it == params_of_chunk.end()) return;
    for (size_t i : it->second) {
      Param& p = params[i];
      if (!p.storage) continue;  // still being attached
      void* at = tier == Tier::kDevice ? static_cast<float*>(ptr) + p.offset : nullptr;
      p.storage->set_data_ptr_noswap(c10::DataPtr(at, device));
    }
  }

  // Makes `chunk` resident on `tier` and pins the given slots (HOLD -> COMPUTE).
  void pin(ChunkId chunk, Tier tier, const std::vector<size_t>& slots) {
    mgr->access(chunk, tier);
    size_t done = 0;
    try {
      for (; done < slots.size(); ++done) mgr->transition(chunk, slots[done], TensorState::kCompute);
    } catch (...) {
      for (size_t k = 0; k < done; ++k) mgr->transition(chunk, slots[k], TensorState::kHold);
      throw;
    }
  }
  void unpin(ChunkId chunk, const std::vector<size_t>& slots) {
    for (size_t s : slots) mgr->transition(chunk, s, TensorState::kHold);
  }
  std::vector<size_t> all_slots(ChunkId chunk) const {
    std::vector<size_t> s(mgr->chunk(chunk).num_tensors());
    for (size_t i = 0; i < s.size(); ++i) s[i] = i;
    return s;
  }

  void before_op(const c10::OperatorHandle& op, const std::vector<int64_t>& ids) override {
    // The operator's working set on the device: every distinct chunk it touches.
    std::vector<ChunkId> chunks;
    uint64_t needed = 0;
    for (int64_t id : ids) {
      const ChunkId c = param_chunk(params[id]);
      if (std::find(chunks.begin(), chunks.end(), c) != chunks.end()) continue;
      chunks.push_back(c);
      needed += mgr->chunk(c).alloc_bytes();
    }
    const uint64_t budget = mgr->tier_stats(Tier::kDevice).budget;
    STRATA_CHECK(needed <= budget, "operator ", op.schema().name(), " on parameter '", params[ids.front()].name,
                 "' needs ", format_bytes(needed), " of parameter chunks on the device tier at once (", chunks.size(),
                 " chunks), more than the device budget of ", format_bytes(budget),
                 "; raise the device budget or lower the chunk size");
    std::vector<std::pair<ChunkId, size_t>> pinned;
    try {
      for (int64_t id : ids) {
        const Param& p = params[id];
        const ChunkId c = param_chunk(p);
        pin(c, Tier::kDevice, {p.slot});
        pinned.emplace_back(c, p.slot);
      }
    } catch (...) {
      for (const auto& [c, s] : pinned) mgr->transition(c, s, TensorState::kHold);
      throw;
    }
  }

  void after_op(const c10::OperatorHandle&, const std::vector<int64_t>& ids) override {
    for (int64_t id : ids) mgr->transition(param_chunk(params[id]), params[id].slot, TensorState::kHold);
  }

  // Adds a gradient into the parameter's slot of its gradient chunk.
  void accumulate_grad(size_t index, const torch::Tensor& grad) {
    std::lock_guard<std::mutex> lock(grad_mu);
    Param& p = params[index];
    const ChunkId gc = mgr->family(p.family).grad;
    pin(gc, Tier::kHost, {p.slot});
    const torch::Tensor g = grad.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    float* dst = static_cast<float*>(mgr->data(gc)) + p.offset;
    const float* src = g.data_ptr<float>();
    for (int64_t k = 0; k < p.numel; ++k) dst[k] += src[k];
    unpin(gc, {p.slot});
    p.has_grad = true;
  }

  void zero_grads() {
    for (memory::FamilyId f : families) {
      const ChunkId gc = mgr->family(f).grad;
      if (!mgr->chunk(gc).location()) continue;  // never materialised: zero already
      const auto slots = all_slots(gc);
      pin(gc, Tier::kHost, slots);
      std::memset(mgr->data(gc), 0, mgr->chunk(gc).payload_bytes());
      unpin(gc, slots);
    }
    for (Param& p : params) p.has_grad = false;
  }

  double step(double& grad_norm) {
    const float average = 1.0f / static_cast<float>(options.grad_accumulation);
    kernels::GradStats total;
    for (memory::FamilyId f : families) {
      const ChunkId gc = mgr->family(f).grad;
      if (!mgr->chunk(gc).location()) continue;
      const auto slots = all_slots(gc);
      pin(gc, Tier::kHost, slots);
      total.merge(kernels::grad_stats(mgr->data(gc), DType::kFloat32, mgr->chunk(gc).capacity_elems()));
      unpin(gc, slots);
    }
    grad_norm = std::sqrt(total.sum_sq) * average;
    STRATA_CHECK(total.finite, "gradients hold inf or nan in an fp32 run; the step is skipped");
    float scale = average;
    if (options.clip_norm > 0) scale *= kernels::clip_coefficient(grad_norm, options.clip_norm);
    for (memory::FamilyId f : families) {
      const memory::ChunkFamily& fam = mgr->family(f);
      const std::vector<ChunkId> members = {fam.param, fam.grad, fam.optim_states[0], fam.optim_states[1]};
      const auto slots = all_slots(fam.param);
      std::vector<ChunkId> pinned;
      try {
        for (ChunkId c : members) {
          pin(c, Tier::kHost, slots);
          pinned.push_back(c);
        }
        float* w = static_cast<float*>(mgr->data(fam.param));
        const float* g = static_cast<const float*>(mgr->data(fam.grad));
        float* m = static_cast<float*>(mgr->data(fam.optim_states[0]));
        float* v = static_cast<float*>(mgr->data(fam.optim_states[1]));
        for (size_t i : params_of_chunk[fam.param]) {
          Param& p = params[i];
          if (!p.has_grad) continue;  // unused this step: no update, as torch.optim
          kernels::AdamParams ap;
          ap.lr = opt.lr;
          ap.beta1 = opt.beta1;
          ap.beta2 = opt.beta2;
          ap.eps = opt.eps;
          ap.weight_decay = opt.weight_decay;
          ap.step = ++p.steps;
          ap.grad_scale = scale;
          ap.grads_known_finite = true;
          kernels::OptimSpans s;
          s.n = p.numel;
          s.master = w + p.offset;
          s.grad = g + p.offset;
          s.state0 = m + p.offset;
          s.state1 = v + p.offset;
          kernels::adam_step(ap, s);
        }
      } catch (...) {
        for (ChunkId c : pinned) unpin(c, slots);
        throw;
      }
      for (ChunkId c : pinned) unpin(c, slots);
    }
    zero_grads();
    return grad_norm;
  }

  void detach_all() noexcept {
    try {
      if (hook) {
        for (Param& p : params) hook->untrack(p.tensor);
      }
      std::unordered_map<ChunkId, std::vector<float>> copies;
      for (Param& p : params) {
        const ChunkId c = param_chunk(p);
        auto& data = copies[c];
        if (data.empty()) {
          data.resize(mgr->chunk(c).capacity_elems());
          if (mgr->chunk(c).location()) mgr->read(c, data.data(), data.size() * sizeof(float));
        }
        torch::NoGradGuard no_grad;
        torch::Tensor owned = torch::from_blob(data.data() + p.offset, p.tensor.sizes(), torch::kFloat32)
                                  .clone()
                                  .to(p.original_device);
        p.tensor.set_data(owned);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[strata error] could not give parameters their memory back: %s\n", e.what());
    }
  }
};

Engine::Engine(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.opt = optimizer;
  s.options = options;
  STRATA_CHECK(options.grad_accumulation >= 1, "gradient accumulation steps must be at least 1, got ",
               options.grad_accumulation);
  memory::ChunkManagerOptions mo;
  mo.budgets = options.budgets;
  if (options.budgets.nvme > 0) {
    offload::NvmeStoreOptions no;
    no.directory = options.nvme_dir;
    no.capacity = options.budgets.nvme;
    mo.nvme = std::make_shared<memory::NvmeSwapStore>(no);
  }
  s.mgr = std::make_unique<memory::ChunkManager>(std::move(mo));
  s.device = s.mgr->device().kind() == offload::DeviceKind::kCuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);

  // Trainable parameters, each once (tied weights appear under several names).
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<memory::TensorSpec> specs;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const torch::Tensor& t = item.value();
    if (!t.requires_grad() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
    STRATA_CHECK(t.scalar_type() == torch::kFloat32, "parameter ", item.key(), " is ", t.scalar_type(),
                 "; this engine slice trains fp32 parameters (mixed precision comes with the engine issue)");
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

  memory::FamilySpec spec;
  spec.optim_states = 2;
  memory::Registration reg;
  if (options.chunk_elems > 0) {
    reg = s.mgr->register_tensors(specs, spec, options.chunk_elems);
  } else {
    // Least padding in [64 Ki, 64 Mi] elements; the manager caps it at a quarter of the device budget.
    reg = s.mgr->register_tensors(specs, spec, memory::ChunkSizeSearch{1 << 16, 64 << 20, 1 << 14, 1});
  }
  s.families = reg.families;
  for (size_t i = 0; i < s.params.size(); ++i) {
    Impl::Param& p = s.params[i];
    p.family = reg.tensors[i].family;
    p.slot = reg.tensors[i].slot;
    p.offset = reg.tensors[i].offset;
    s.params_of_chunk[s.mgr->family(p.family).param].push_back(i);
  }
  s.mgr->set_placement_listener(
      [&s](const memory::Chunk& c, std::optional<Tier> tier, void* ptr) { s.on_placed(c, tier, ptr); });

  // Copy each parameter into its slot (on host), then give the tensor a
  // storage that follows the chunk; the original storage is released.
  torch::NoGradGuard no_grad;
  for (memory::FamilyId f : s.families) {
    const memory::ChunkFamily& fam = s.mgr->family(f);
    for (ChunkId c : fam.members()) {
      for (size_t slot = 0; slot < s.mgr->chunk(c).num_tensors(); ++slot) s.mgr->transition(c, slot, TensorState::kHold);
    }
  }
  for (size_t i = 0; i < s.params.size(); ++i) {
    Impl::Param& p = s.params[i];
    const ChunkId c = s.param_chunk(p);
    s.pin(c, Tier::kHost, {p.slot});
    const torch::Tensor src = p.tensor.detach().to(torch::kCPU).contiguous();
    std::memcpy(static_cast<float*>(s.mgr->data(c)) + p.offset, src.data_ptr<float>(), p.numel * sizeof(float));
    s.unpin(c, {p.slot});
    p.storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                      static_cast<size_t>(p.numel) * sizeof(float),
                                                      c10::DataPtr(nullptr, s.device), nullptr, false);
    torch::Tensor view = torch::empty({0}, torch::TensorOptions().dtype(torch::kFloat32).device(s.device))
                             .set_(c10::Storage(p.storage), 0, p.tensor.sizes(), p.tensor.strides());
    p.tensor.set_data(view);
  }
  s.hook = std::make_unique<OpHook>(s);
  for (size_t i = 0; i < s.params.size(); ++i) {
    s.hook->track(s.params[i].tensor, static_cast<int64_t>(i));
    Impl* self = &s;
    s.params[i].tensor.register_hook([self, i](torch::Tensor grad) {
      self->accumulate_grad(i, grad);
      return grad;
    });
  }
}

Engine::~Engine() {
  if (impl_) impl_->detach_all();
}

StepResult Engine::train_step(const std::function<torch::Tensor()>& loss_fn) {
  Impl& s = *impl_;
  StepResult r;
  {
    OpHook::Scope scope(*s.hook);
    torch::Tensor loss = loss_fn();
    r.loss = loss.item<double>();
    loss.backward();
  }
  for (auto& p : s.params) {
    if (p.tensor.grad().defined()) p.tensor.mutable_grad().reset();  // strata holds the gradient in its chunk
  }
  if (++s.micro_steps % s.options.grad_accumulation == 0) {
    s.step(r.grad_norm);
    r.stepped = true;
  }
  return r;
}

torch::Tensor Engine::run(const std::function<torch::Tensor()>& fn) {
  OpHook::Scope scope(*impl_->hook);
  torch::NoGradGuard no_grad;
  torch::Tensor out = fn();
  return out.clone();  // owned: it must not alias a parameter chunk
}

void Engine::zero_grad() {
  impl_->zero_grads();
  impl_->micro_steps = 0;
}

memory::ChunkManager& Engine::chunks() { return *impl_->mgr; }

int64_t Engine::managed_parameters() const {
  int64_t n = 0;
  for (const auto& p : impl_->params) n += p.numel;
  return n;
}

int64_t Engine::model_state_bytes() const { return managed_parameters() * 4 * 4; }

std::unique_ptr<Engine> attach(torch::nn::Module& module, AdamWConfig optimizer, EngineOptions options) {
  return std::make_unique<Engine>(module, optimizer, std::move(options));
}

}  // namespace strata::parallel
