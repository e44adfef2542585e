#include "param_access.h"

#include <torch/torch.h>

#include "../zero/sharding.h"
#include "grad_sink.h"
#include "strata/parallel/op_hook.h"

namespace strata::parallel {

namespace {

std::string shape_text(c10::IntArrayRef s) {
  std::string out = "[";
  for (size_t k = 0; k < s.size(); ++k) out += (k ? ", " : "") + std::to_string(s[k]);
  return out + "]";
}

// The slots of `c` that hold parameter `p`'s elements: a shard chunk has one.
std::vector<size_t> slots_of(const EngineContext& ctx, ChunkId c, const ManagedParam& p) {
  return ctx.mgr->chunk(c).shard() ? std::vector<size_t>{0} : std::vector<size_t>{p.slot};
}

}  // namespace

ParamAccess::ParamAccess(EngineContext& ctx, GradSink& sink) : ctx_(ctx), sink_(sink) {
  for (size_t i = 0; i < ctx.params.size(); ++i) {
    by_tensor_[ctx.params[i].tensor.unsafeGetTensorImpl()] = i;  // the TensorImpl outlives set_data
    by_name_[ctx.params[i].name] = i;
  }
}

size_t ParamAccess::find(const torch::Tensor& t) const {
  STRATA_CHECK(t.defined(), "pass a parameter of the attached module, not an undefined tensor");
  const auto it = by_tensor_.find(t.unsafeGetTensorImpl());
  if (it != by_tensor_.end()) return it->second;
  STRATA_FAIL("this tensor (", shape_text(t.sizes()), ") is not a trainable parameter of the attached module; pass "
              "the parameter itself (module->named_parameters()), not a view or a copy, or its name");
}

size_t ParamAccess::find(const std::string& name) const {
  const auto it = by_name_.find(name);
  if (it != by_name_.end()) return it->second;
  STRATA_FAIL("no trainable parameter named \"", name, "\" (names as module.named_parameters() gives them; a tied "
              "parameter goes by its first name, frozen ones are not managed)");
}

bool ParamAccess::replaced(size_t i) const {
  const ManagedParam& p = ctx_.params[i];
  return !p.tensor.has_storage() || p.tensor.storage().unsafeGetStorageImpl() != p.storage.get() ||
         p.tensor.scalar_type() != ctx_.compute || p.tensor.device() != ctx_.device;
}

void ParamAccess::land_written(size_t i) {
  const ManagedParam& p = ctx_.params[i];
  const memory::ChunkFamily& fam = ctx_.mgr->family(p.family);
  if (!fam.master && !fam.param_shard) return;  // fp32, stages 0-2: the parameter chunk is the master
  store(i, p.tensor, /*in_chunk=*/true, /*pinned=*/true);
}

void ParamAccess::absorb(size_t i, bool pinned) {
  ManagedParam& p = ctx_.params[i];
  auto bypass = OpHook::bypass();
  torch::NoGradGuard no_grad;
  const torch::Tensor value = p.tensor.detach();  // keeps the new data alive
  // The parameter's own storage back, whatever happens next.
  std::vector<int64_t> strides(p.shape.size(), 1);
  for (int64_t k = static_cast<int64_t>(p.shape.size()) - 2; k >= 0; --k) {
    strides[static_cast<size_t>(k)] = strides[static_cast<size_t>(k) + 1] * p.shape[static_cast<size_t>(k) + 1];
  }
  torch::Tensor own = torch::empty({0}, torch::TensorOptions().dtype(ctx_.compute).device(ctx_.device))
                          .set_(c10::Storage(p.storage), 0, p.shape, strides);
  p.tensor.set_data(own);
  OpHook::mark(p.tensor);  // set_data took the key set of `own`
  sink_.reinstall(i);      // a change of dtype or device gave the parameter a new gradient accumulator
  STRATA_CHECK(value.sizes().vec() == p.shape, "parameter ", p.name, " was given data of shape ",
               shape_text(value.sizes()), " but it is ", shape_text(p.shape),
               " while strata is attached; its previous values are kept. Copy values of its shape into it "
               "(param.copy_(x) under torch::NoGradGuard)");
  STRATA_CHECK(value.is_floating_point(), "parameter ", p.name, " was given ", value.scalar_type(),
               " data; give it floating-point values. Its previous values are kept");
  store(i, value, /*in_chunk=*/false, pinned);
}

void ParamAccess::absorb_replaced() {
  for (size_t i = 0; i < ctx_.params.size(); ++i) {
    if (replaced(i)) absorb(i, /*pinned=*/false);
  }
}

void ParamAccess::store(size_t i, const torch::Tensor& values, bool in_chunk, bool pinned) {
  ManagedParam& p = ctx_.params[i];
  auto bypass = OpHook::bypass();
  torch::NoGradGuard no_grad;
  const memory::ChunkFamily& fam = ctx_.mgr->family(p.family);
  const torch::Tensor flat = values.detach().reshape({-1}).to(torch::kCPU).contiguous();
  if (!in_chunk && pinned) {
    p.tensor.copy_(values);
  } else if (!in_chunk && !fam.param_shard) {
    const ChunkId c = ctx_.param_chunk(p);
    ctx_.pin(c, Tier::kDevice, {p.slot});
    try {
      p.tensor.copy_(values);
    } catch (...) {
      ctx_.unpin(c, {p.slot});
      throw;
    }
    ctx_.unpin(c, {p.slot});
  }
  const auto [begin, end] = ctx_.owned(p);
  if (begin >= end) return;
  const torch::Tensor part = flat.slice(0, begin - p.offset, end - p.offset);
  const auto write = [&](ChunkId c, const std::function<void(char*)>& fn) {
    const std::vector<size_t> slots = slots_of(ctx_, c, p);
    ctx_.pin(c, Tier::kHost, slots);
    try {
      fn(ctx_.at(c, begin));
    } catch (...) {
      ctx_.unpin(c, slots);
      throw;
    }
    ctx_.unpin(c, slots);
  };
  if (fam.param_shard) {
    write(*fam.param_shard, [&](char* dst) {
      torch::from_blob(dst, {end - begin}, torch::TensorOptions().dtype(ctx_.compute)).copy_(part);
    });
  }
  if (fam.master) {
    write(*fam.master, [&](char* dst) {
      torch::Tensor master = torch::from_blob(dst, {end - begin}, torch::kFloat32);
      if (part.scalar_type() == torch::kFloat32) {
        master.copy_(part);  // fp32 values: exactly
      } else {
        // Only the elements the write changed: the others keep their fp32 precision.
        const torch::Tensor changed = master.to(part.scalar_type()).ne(part);
        master.copy_(torch::where(changed, part.to(torch::kFloat32), master));
      }
    });
  }
}

void ParamAccess::check_grads(size_t i, const char* what) const {
  STRATA_CHECK(grads_open_, what, "(", ctx_.params[i].name, ") works between backward and the optimizer step: "
               "call it in the before_step callback of train_step(loss_fn, before_step). Outside it the gradients "
               "are not complete (mid-backward) or no longer exist (the step consumed them)");
}

torch::Tensor ParamAccess::grad(size_t i) {
  check_grads(i, "engine->grad");
  const ManagedParam& p = ctx_.params[i];
  if (!p.has_grad) return torch::Tensor();  // no rank used it: as torch, no gradient
  auto bypass = OpHook::bypass();
  torch::NoGradGuard no_grad;
  const memory::ChunkFamily& fam = ctx_.mgr->family(p.family);
  const auto opts = torch::TensorOptions().dtype(ctx_.compute);
  torch::Tensor out;
  if (fam.grad_shard) {
    // Stages 2-3: each rank holds its shard; every rank takes part (collective).
    const ChunkId gs = *fam.grad_shard;
    const int64_t capacity = fam.layout->capacity_elems;
    torch::Tensor whole = torch::empty({capacity}, opts);
    ctx_.with_on_host({gs}, [&] { gather_shards(ctx_, gs, ctx_.mgr->data(gs), whole.data_ptr()); });
    ctx_.collectives += 1;
    out = whole.slice(0, p.offset, p.offset + p.numel).to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
  } else {
    ctx_.pin(fam.grad, Tier::kHost, {p.slot});
    // A copy even when the chunk is fp32: the scaling below must not touch the gradient the step applies.
    out = torch::from_blob(ctx_.at(fam.grad, p.offset), {p.numel}, opts).to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
    ctx_.unpin(fam.grad, {p.slot});
  }
  return out.mul_(grad_factor_).reshape(p.shape);
}

void ParamAccess::set_grad(size_t i, const torch::Tensor& g) {
  check_grads(i, "engine->set_grad");
  ManagedParam& p = ctx_.params[i];
  STRATA_CHECK(g.defined() && g.sizes().vec() == p.shape && g.is_floating_point(), "set_grad(", p.name,
               "): give a floating-point tensor of shape ", shape_text(p.shape));
  auto bypass = OpHook::bypass();
  torch::NoGradGuard no_grad;
  const memory::ChunkFamily& fam = ctx_.mgr->family(p.family);
  const torch::Tensor raw = (g.detach().to(torch::kCPU, torch::kFloat32) / grad_factor_).reshape({-1}).to(ctx_.compute);
  const ChunkId gc = fam.grad_shard ? *fam.grad_shard : fam.grad;
  // Stages 2-3: this rank's part of the shard; before: the whole slot, which every rank holds reduced.
  const auto [begin, end] = fam.grad_shard ? ctx_.owned(p) : std::pair<int64_t, int64_t>{p.offset, p.offset + p.numel};
  if (begin < end) {
    const std::vector<size_t> slots = slots_of(ctx_, gc, p);
    ctx_.pin(gc, Tier::kHost, slots);
    torch::from_blob(ctx_.at(gc, begin), {end - begin}, torch::TensorOptions().dtype(ctx_.compute))
        .copy_(raw.slice(0, begin - p.offset, end - p.offset));
    ctx_.unpin(gc, slots);
  }
  p.has_grad = true;
}

}  // namespace strata::parallel
