#include "step_pipeline.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <limits>
#include <numeric>
#include <tuple>
#include <utility>

#include "../zero/gathers.h"
#include "grad_sink.h"
#include "strata/core/log.h"
#if defined(STRATA_HAVE_CUDA_KERNELS)
#include "strata/kernels/cuda_optim.h"
#endif

namespace strata::parallel {

StepPipeline::StepPipeline(EngineContext& ctx, GradSink& sink, StepGathers* gathers)
    : ctx_(ctx), sink_(sink), gathers_(gathers) {
  scale_ = ctx.options.precision == DType::kFloat16 ? ctx.options.loss_scale.initial : 1.0;
}

StepPipeline::~StepPipeline() {
  drain_updates();
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (updater_.joinable()) updater_.join();
  EngineContext::settle(early_ahead_);
  for (auto& t : early_behind_) t.wait();
}

void StepPipeline::restore_scaler(double scale, int clean_steps, int64_t skipped) {
  scale_ = ctx_.options.precision == DType::kFloat16 ? scale : 1.0;
  clean_steps_ = clean_steps;
  skipped_ = skipped;
}

void StepPipeline::place_optimizer_state() {
  place_nvme_families();
  place_device_families();
}

void StepPipeline::place_nvme_families() {
  optim_on_nvme_.assign(ctx_.families.size(), false);
  if (ctx_.options.budgets.nvme == 0) return;
  std::vector<uint64_t> bytes;
  for (memory::FamilyId f : ctx_.families) {
    uint64_t b = 0;
    for (ChunkId c : ctx_.optim_members(f)) b += ctx_.mgr->chunk(c).alloc_bytes();
    bytes.push_back(b);
  }
  const size_t n = ctx_.families.size();
  const size_t on_nvme =
      memory::nvme_optim_families(bytes, ctx_.options.nvme_optim_fraction, ctx_.options.budgets.host);
  for (size_t i = n - on_nvme; i < n; ++i) optim_on_nvme_[i] = true;
}

void StepPipeline::place_device_families() {
  const size_t n = ctx_.families.size();
  optim_on_device_.assign(n, false);
  const auto on_device = static_cast<size_t>(std::llround(ctx_.options.device_optim_fraction * static_cast<double>(n)));
#if !defined(STRATA_HAVE_CUDA_KERNELS)
  STRATA_CHECK(on_device == 0 || ctx_.mgr->device().host_accessible(), "device_optim_fraction ",
               ctx_.options.device_optim_fraction, " updates optimizer state on a CUDA device, but strata was built "
               "without its CUDA kernels; rebuild with the CUDA toolkit or set device_optim_fraction to 0");
#endif
  for (size_t i = 0; i < on_device; ++i) {
    STRATA_CHECK(!optim_on_nvme_[i], "device_optim_fraction ", ctx_.options.device_optim_fraction, " puts ", on_device,
                 " of ", n, " chunk families' optimizer state on the device, but family ", i,
                 " keeps it on NVMe (nvme_optim_fraction); lower one of the two fractions so they do not overlap");
    // The update pins the family's step members on the device together.
    uint64_t bytes = 0;
    for (ChunkId c : ctx_.step_members(ctx_.families[i])) bytes += ctx_.mgr->chunk(c).alloc_bytes();
    STRATA_CHECK(bytes <= ctx_.options.budgets.device, "device_optim_fraction ", ctx_.options.device_optim_fraction,
                 ": updating chunk family ", i, " on the device needs its parameters, gradients and optimizer state "
                 "there together, ", format_bytes(bytes), ", more than the device budget ",
                 format_bytes(ctx_.options.budgets.device), "; raise the device budget, lower the chunk size, or "
                 "lower device_optim_fraction");
    optim_on_device_[i] = true;
  }
}

void StepPipeline::read_state_early() {
  memory::ChunkManager& mgr = *ctx_.mgr;
  const memory::TierStats host = mgr.tier_stats(Tier::kHost);
  uint64_t reserve = 0;
  for (memory::FamilyId f : ctx_.families) {
    for (ChunkId c : {ctx_.step_grad(f), ctx_.step_param(f)}) {
      if (!mgr.chunk(c).resident_on(Tier::kHost)) reserve += mgr.chunk(c).alloc_bytes();
    }
  }
  uint64_t planned = host.used + reserve;
  for (size_t i = 0; i < ctx_.families.size(); ++i) {
    if (!optim_on_nvme_[i]) continue;
    std::vector<ChunkId> wanted;
    uint64_t bytes = 0;
    for (ChunkId c : ctx_.optim_members(ctx_.families[i])) {
      if (mgr.chunk(c).resident_on(Tier::kNvme)) {
        wanted.push_back(c);
        bytes += mgr.chunk(c).alloc_bytes();
      }
    }
    if (planned + bytes > host.budget) break;
    planned += bytes;
    for (ChunkId c : wanted) early_.push_back(mgr.prefetch(c, Tier::kHost));
  }
}

void StepPipeline::track_gradients(bool on) {
  track_ = on;
  early_stats_.assign(ctx_.families.size(), std::nullopt);
  early_replicated_.assign(ctx_.families.size(), 0.0);
}

void StepPipeline::gradients_arrived(memory::FamilyId f, bool complete) {
  if (!track_) return;
  const size_t pos = ctx_.family_pos.at(f);
  early_stats_[pos].reset();  // a gradient arrived: what was taken before no longer holds
  const ChunkId gc = ctx_.step_grad(f);
  memory::ChunkManager& mgr = *ctx_.mgr;
  if (!complete || gc != mgr.family(f).grad || !mgr.chunk(gc).resident_on(Tier::kHost)) return;
  std::tie(early_stats_[pos], early_replicated_[pos]) = stats_of(f);
}

std::pair<kernels::GradStats, double> StepPipeline::stats_of(memory::FamilyId f) const {
  const ChunkId gc = ctx_.step_grad(f);
  const memory::ChunkManager& mgr = *ctx_.mgr;
  return {kernels::grad_stats(mgr.data(gc), ctx_.options.precision, mgr.chunk(gc).capacity_elems()),
          ctx_.tensor_group != nullptr || ctx_.stages_tied ? replicated_sum_sq(f) : 0.0};
}

// Note [Updates in backward]
void StepPipeline::begin_backward(bool fuse) {
  std::lock_guard<std::mutex> lock(fuse_mu_);
  const size_t n = ctx_.families.size();
  counting_ = true;
  arrivals_.assign(ctx_.params.size(), 0);
  first_arrivals_.assign(n, 0);
  trainable_.assign(n, 0);
  trainable_elems_.assign(n, 0);
  for (const ManagedParam& p : ctx_.params) {
    if (p.accumulator == nullptr) continue;  // frozen: never arrives
    const size_t pos = ctx_.family_pos.at(p.family);
    trainable_[pos] += 1;
    trainable_elems_[pos] += p.numel;
  }
  updated_early_.assign(n, false);
  order_.clear();
  fusing_ = fuse && expected_.size() == ctx_.params.size() &&
            (ctx_.options.clip_norm == 0 || previous_norm_.has_value());
  if (!fusing_) return;
  unsettled_.assign(n, 0);
  for (size_t i = 0; i < ctx_.params.size(); ++i) {
    const ManagedParam& p = ctx_.params[i];
    if (p.accumulator == nullptr) continue;  // frozen: never arrives
    const size_t pos = ctx_.family_pos.at(p.family);
    unsettled_[pos] = expected_[i] > 0 && unsettled_[pos] < kNever ? unsettled_[pos] + 1 : kNever;
  }
  for (size_t pos = 0; pos < n; ++pos) {
    if (optim_on_device_[pos] || unsettled_[pos] == 0) unsettled_[pos] = kNever;
  }
  done_sq_ = 0.0;
  done_elems_ = 0;
  all_elems_ = std::accumulate(trainable_elems_.begin(), trainable_elems_.end(), int64_t{0});
  early_lrs_.resize(ctx_.groups.size());
  for (size_t g = 0; g < early_lrs_.size(); ++g) early_lrs_[g] = static_cast<float>(current_lr(g));
}

void StepPipeline::gradient_settled(size_t index) {
  std::lock_guard<std::mutex> lock(fuse_mu_);
  if (!counting_) return;
  const ManagedParam& p = ctx_.params[index];
  const size_t pos = ctx_.family_pos.at(p.family);
  const int n = ++arrivals_[index];
  STRATA_CHECK(!updated_early_[pos], "parameter ", p.name, "'s gradient arrived (", n, " times in this backward, ",
               index < expected_.size() ? expected_[index] : 0, " in the one before) after update_in_backward had "
               "updated its chunk family with the gradients before it; the model uses this parameter differently "
               "from step to step, which updates in backward cannot follow. The step is abandoned, but that family "
               "keeps the update; set update_in_backward false and resume from a checkpoint");
  if (n == 1 && ++first_arrivals_[pos] == trainable_[pos]) order_.push_back(pos);
  if (!fusing_) return;
  if (unsettled_[pos] >= kNever) return;
  if (n > expected_[index]) {  // used more often than the step before: the step updates it
    unsettled_[pos] = kNever;
    return;
  }
  if (n < expected_[index] || --unsettled_[pos] > 0) return;
  if (!update_early(pos)) unsettled_[pos] = kNever;
}

bool StepPipeline::update_early(size_t pos) {
  const memory::FamilyId f = ctx_.families[pos];
  if (!early_stats_[pos]) {  // an arrival after the sink saw the family complete forgot them
    ctx_.with_on_host({ctx_.step_grad(f)}, [&] { std::tie(early_stats_[pos], early_replicated_[pos]) = stats_of(f); });
  }
  if (!early_stats_[pos]->finite) return false;  // the step skips; nothing is updated here
  double norm = 0.0;  // what the family is clipped by; without clipping, unused
  if (ctx_.options.clip_norm > 0) {  // Note [Updates in backward]: the norm as far as it is known
    done_sq_ += early_stats_[pos]->sum_sq;
    done_elems_ += trainable_elems_[pos];
    const double pending = 1.0 - static_cast<double>(done_elems_) / static_cast<double>(std::max<int64_t>(1, all_elems_));
    const double previous = *previous_norm_;
    norm = std::sqrt(done_sq_ * unscale() * unscale() + previous * previous * std::max(0.0, pending));
  }
  const auto grad_scale = static_cast<float>(multiplier(norm));
  updated_early_[pos] = true;
  {
    std::unique_lock<std::mutex> lock(queue_mu_);
    if (!updater_.joinable()) {
      updater_ = std::thread([this] { run_updates(); });
      updater_id_ = updater_.get_id();
    }
    // One family waiting beside the one updating: backward does not run further ahead, so the
    // gradients waiting for their update (on host, where the sink wrote them) stay few.
    queue_cv_.wait(lock, [&] { return queue_.empty(); });
    queue_.push_back({pos, grad_scale});
  }
  queue_cv_.notify_all();
  return true;
}

void StepPipeline::run_updates() {
  for (;;) {
    EarlyUpdate u{};
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything given ran
      u = queue_.front();
      queue_.pop_front();
      ++running_;
    }
    bool ran = false;  // the kernel ran: the family is updated, whatever fails after
    std::exception_ptr failed;
    try {
      update_one(u, ran);
    } catch (const std::exception& e) {
      if (ran) {
        failed = std::current_exception();
      } else {  // its chunks could not be pinned: the family is as it was
        STRATA_LOG(kDebug, "chunk family {} could not be updated in backward ({}); the step updates it", u.pos,
                   e.what());
      }
    }
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (!ran) returned_.push_back(u.pos);
      if (failed && !update_error_) update_error_ = failed;
      --running_;
      ++finished_;
    }
    queue_cv_.notify_all();
  }
}

void StepPipeline::update_one(const EarlyUpdate& u, bool& ran) {
  memory::ChunkManager& mgr = *ctx_.mgr;
  const memory::FamilyId f = ctx_.families[u.pos];
  // Once pinned: reads the state of the family that became final after this one in the backward before.
  const auto pinned = [&] {
    ran = true;
    const size_t next = u.pos < next_final_.size() ? next_final_[u.pos] : kNone;
    if (!ctx_.options.prefetch || next == kNone) return;
    const std::vector<ChunkId> state = ctx_.optim_members(ctx_.families[next]);
    for (ChunkId c : state) {
      if (mgr.chunk(c).resident_on(Tier::kHost)) mgr.access(c, Tier::kHost);  // most recently used: not a victim
    }
    ctx_.read_ahead(state, early_ahead_, /*only_into_free=*/false);
  };
  // Note [Updated parameters leave first]: backward updates families in the reverse of forward's order.
  update_family(u.pos, Tier::kHost, u.grad_scale, early_lrs_, pinned, updater_waited_, memory::Demotion::kFirstFirst);
  if (optim_on_nvme_[u.pos]) {
    for (ChunkId c : ctx_.optim_members(f)) early_behind_.push_back(mgr.prefetch(c, Tier::kNvme));
  }
}

void StepPipeline::drain_updates() noexcept {
  std::unique_lock<std::mutex> lock(queue_mu_);
  queue_cv_.wait(lock, [&] { return queue_.empty() && running_ == 0; });
  ctx_.wait.optimizer += updater_waited_;
  updater_waited_ = 0.0;
  for (size_t pos : returned_) {
    if (pos < updated_early_.size()) updated_early_[pos] = false;
  }
  returned_.clear();
}

bool StepPipeline::wait_for_an_update() {
  if (std::this_thread::get_id() == updater_id_) return false;
  std::unique_lock<std::mutex> lock(queue_mu_);
  if (queue_.empty() && running_ == 0) return false;
  const uint64_t before = finished_;
  queue_cv_.wait(lock, [&] { return finished_ != before || (queue_.empty() && running_ == 0); });
  return true;
}

void StepPipeline::end_backward() {
  std::lock_guard<std::mutex> lock(fuse_mu_);  // the step drained the updater first
  if (counting_) {
    expected_ = arrivals_;
    next_final_.assign(ctx_.families.size(), kNone);
    for (size_t k = 0; k + 1 < order_.size(); ++k) next_final_[order_[k]] = order_[k + 1];
  }
  counting_ = false;
  fusing_ = false;
  EngineContext::settle(early_ahead_);
  std::vector<offload::CopyTicket> behind = std::move(early_behind_);
  early_behind_.clear();
  for (auto& t : behind) offload::CopyEngine::wait(t);  // a failed write-back is the step's error
}

void StepPipeline::abandon_backward() noexcept {
  drain_updates();
  std::lock_guard<std::mutex> lock(fuse_mu_);
  counting_ = false;
  fusing_ = false;
  updated_early_.clear();
  EngineContext::settle(early_ahead_);
  for (auto& t : early_behind_) t.wait();
  early_behind_.clear();
}

double StepPipeline::unscale() const { return 1.0 / (ctx_.options.grad_accumulation * ctx_.world()) / scale_; }

double StepPipeline::multiplier(double norm) const {
  double m = unscale();
  if (ctx_.options.clip_norm > 0) m *= kernels::clip_coefficient(norm, ctx_.options.clip_norm);
  return m;
}

// One read of every gradient chunk whose statistics backward did not take
// (Note [Gradient statistics as families complete]); at stages 2-3 the
// ranks' partial sums of their shards are summed in rank order, so every
// rank gets the same norm.
kernels::GradStats StepPipeline::grad_stats() {
  memory::ChunkManager& mgr = *ctx_.mgr;
  kernels::GradStats total;
  double replicated = 0.0;  // Note [Clipping across the tensor group]
  std::vector<offload::CopyTicket> ahead;
  const std::vector<std::optional<kernels::GradStats>> early = std::move(early_stats_);
  const std::vector<double> early_replicated = std::move(early_replicated_);
  track_gradients(false);
  const auto taken = [&](size_t i) { return i < early.size() && early[i].has_value(); };
  for (size_t i = 0; i < ctx_.families.size(); ++i) {
    const ChunkId gc = ctx_.step_grad(ctx_.families[i]);
    if (taken(i)) {  // before the chunk: a family updated in backward dropped it
      total.merge(*early[i]);
      replicated += early_replicated[i];
      continue;
    }
    if (!mgr.chunk(gc).location()) continue;  // never materialised: no gradient, zero
    const auto slots = ctx_.all_slots(gc);
    const auto waited_from = Clock::now();
    ctx_.pin(gc, Tier::kHost, slots);
    ctx_.wait.optimizer += seconds_since(waited_from);
    size_t next = i + 1;  // the next family this pass reads
    while (next < ctx_.families.size() && taken(next)) ++next;
    if (next < ctx_.families.size() && ctx_.options.prefetch) {
      ctx_.read_ahead({ctx_.step_grad(ctx_.families[next])}, ahead, /*only_into_free=*/true);
    }
    const auto [stats, family_replicated] = stats_of(ctx_.families[i]);  // while it is pinned
    total.merge(stats);
    replicated += family_replicated;
    ctx_.unpin(gc, slots);
  }
  EngineContext::settle(ahead);
  if (ctx_.stage >= 2) {
    const std::vector<double> all =
        all_gather_values(*ctx_.comm, {total.sum_sq, total.finite ? 0.0 : 1.0, replicated});
    ctx_.collectives += 1;
    total = kernels::GradStats{};
    replicated = 0.0;
    for (int r = 0; r < ctx_.world(); ++r) {
      total.merge({all[3 * r], all[3 * r + 1] == 0.0});
      replicated += all[3 * r + 2];
    }
  }
  // The sums of squares and the finite flags over a group, in rank order.
  const auto sum_over = [](Communicator* group, double sum_sq, bool finite) {
    kernels::GradStats sum{sum_sq, finite};
    if (group == nullptr || group->world_size() <= 1) return sum;
    const std::vector<double> all = all_gather_values(*group, {sum_sq, finite ? 0.0 : 1.0});
    sum = kernels::GradStats{};
    for (int r = 0; r < group->world_size(); ++r) sum.merge({all[2 * r], all[2 * r + 1] == 0.0});
    return sum;
  };
  // Note [Clipping across the tensor group]: slices summed over the group,
  // each copy once (and each tied parameter's copies across stages once).
  total.sum_sq -= replicated;
  if (ctx_.tensor_group != nullptr) total = sum_over(ctx_.tensor_group, total.sum_sq, total.finite);
  // Pipeline stages hold disjoint parameters but for tied copies: their
  // squares add up, and one overflow skips every stage's step.
  return sum_over(ctx_.options.pipeline_group.get(), total.sum_sq, total.finite);
}

// Note [Clipping across the tensor group]
// Under tensor parallelism each rank's gradient chunks hold its parts of the
// split parameters, some the same on several ranks of the group (a 2D
// LayerNorm's slice is held once per grid row: tensor_copies_of), and whole
// copies of the replicated ones (biases of row-parallel layers, norms in 1D),
// the same on every rank of the group. The global norm squared counts each
// distinct part once: each rank contributes its chunks' sum minus (1 -
// 1/copies) of each part held by `copies` ranks (P for a replicated one), and
// the contributions are summed over the tensor group (one small all-gather,
// after the data-parallel one).
// A parameter tied across pipeline stages counts the same way, its copies
// being held by stage_copies pipeline ranks as well (Note [Tied parameters
// across stages] in tied_params.h).
double StepPipeline::replicated_sum_sq(memory::FamilyId f) const {
  const ChunkId gc = ctx_.step_grad(f);
  const int group = ctx_.tensor_group != nullptr ? ctx_.tensor_group->world_size() : 1;
  double sum = 0.0;
  for (size_t i : ctx_.params_of_chunk.at(ctx_.mgr->family(f).param)) {
    const ManagedParam& p = ctx_.params[i];
    const int copies = (p.copies == 0 ? group : p.copies) * p.stage_copies;
    if (copies == 1 || !p.has_grad) continue;
    // Stages 2-3 hold this rank's part of the gradient; before, all of it.
    const auto [begin, end] = ctx_.stage >= 2 ? ctx_.owned(p) : std::make_pair(p.offset, p.offset + p.numel);
    if (begin >= end) continue;
    const torch::Tensor g =
        torch::from_blob(ctx_.at(gc, begin), {end - begin}, torch::TensorOptions().dtype(ctx_.compute));
    sum += g.to(torch::kFloat64).pow(2).sum().item<double>() * (1.0 - 1.0 / copies);
  }
  return sum;
}

double StepPipeline::current_lr(size_t group) const {
  return ctx_.groups[group].lr * ctx_.optimizer.schedule.factor(optimizer_steps_);
}

// Pins family `index` on `tier`, calls `pinned_hook` (the read-ahead of the
// next family, which must not evict this one), then updates it.
void StepPipeline::update_family(size_t index, Tier tier, float grad_scale, const std::vector<float>& lrs,
                                 const std::function<void()>& pinned_hook, double& waited, memory::Demotion updated) {
  const memory::FamilyId f = ctx_.families[index];
  const memory::ChunkFamily& fam = ctx_.mgr->family(f);
  // On a GPU the device's memory is not the host's: the CUDA kernels run there.
  const bool on_cuda = tier == Tier::kDevice && !ctx_.mgr->device().host_accessible();
  const auto waited_from = Clock::now();
  // Note [Parameters the update overwrites]
  if (update_overwrites_param(f)) ctx_.mgr->overwrite(ctx_.step_param(f), tier);
  bool updated_any = false;
  ctx_.with_on(tier, ctx_.step_members(f), [&] {
    waited += seconds_since(waited_from);  // the pins above waited for the chunks
    pinned_hook();
    const ChunkId pc = ctx_.step_param(f), gc = ctx_.step_grad(f);
    const ChunkId mc = fam.master ? *fam.master : pc;  // fp32 values: the master, or the fp32 parameters
    for (size_t i : ctx_.params_of_chunk[fam.param]) {
      ManagedParam& p = ctx_.params[i];
      if (!p.has_grad) continue;  // unused this step: no update, as torch.optim
      const auto [begin, end] = ctx_.owned(p);  // Note [ZeRO over chunks]: this rank's part
      updated_any = updated_any || begin < end;
      kernels::OptimSpans s;
      s.n = end - begin;
      if (begin < end) {
        s.master = reinterpret_cast<float*>(ctx_.at(mc, begin));
        s.grad = ctx_.at(gc, begin);
        s.grad_dtype = ctx_.options.precision;
        if (fam.optim_states.size() > 0) s.state0 = reinterpret_cast<float*>(ctx_.at(fam.optim_states[0], begin));
        if (fam.optim_states.size() > 1) s.state1 = reinterpret_cast<float*>(ctx_.at(fam.optim_states[1], begin));
        if (fam.master) {
          s.param_copy = ctx_.at(pc, begin);
          s.param_dtype = ctx_.options.precision;
        }
      }
      update_param(p, s, grad_scale, lrs[p.group], on_cuda);  // counts the step even when this rank owns none of it
    }
  });
  // Note [Clean copies on NVMe] in chunk_manager.h: the update changed the
  // parameters, so a copy kept on NVMe is stale; dropped now, not compared later.
  if (updated_any) ctx_.mgr->forget_nvme_copy(ctx_.step_param(f));
  // Note [Gradients die with their update]
  ctx_.mgr->release(fam.grad);
  if (fam.grad_shard) ctx_.mgr->release(*fam.grad_shard);
  if (tier == Tier::kHost) {
    ctx_.mgr->demote(ctx_.step_param(f), updated);  // Note [Updated parameters leave first]
    // Note [Updated optimizer state leaves before parameters]
    for (ChunkId s : ctx_.optim_members(f)) ctx_.mgr->demote(s, memory::Demotion::kBeforeAll);
  }
}

// Note [Parameters the update overwrites]
// In mixed precision the update writes each parameter's compute copy from
// its fp32 master. When it writes every parameter of the family's step
// parameter chunk (each one has a gradient this step, and this rank updates
// all of its elements in that chunk: stage 0, a ZeRO-3 shard, or one rank),
// the chunk's old bytes are never read: a chunk on NVMe (or on the other
// tier) gets a fresh zero-filled payload where the update runs
// (ChunkManager::overwrite) instead of being read back only to be
// overwritten, and the read-ahead leaves it out. Padding between parameters
// reads back as zeros, as in a chunk materialised for the first time. At 3B
// in bf16 these reads were 3.6 GiB of the optimizer phase's 39 GiB.
bool StepPipeline::update_overwrites_param(memory::FamilyId f) const {
  const memory::ChunkFamily& fam = ctx_.mgr->family(f);
  if (!fam.master) return false;
  const ChunkId pc = ctx_.step_param(f);
  const int64_t lo = ctx_.origin(pc), hi = lo + ctx_.mgr->chunk(pc).capacity_elems();
  for (size_t i : ctx_.params_of_chunk.at(fam.param)) {
    const ManagedParam& p = ctx_.params[i];
    const int64_t begin = std::max(p.offset, lo), end = std::min(p.offset + p.numel, hi);
    if (begin >= end) continue;  // none of it in this rank's shard
    if (!p.has_grad) return false;  // not updated: its bytes stay
    const auto [first, last] = ctx_.owned(p);
    if (first > begin || last < end) return false;  // another rank updates part of it here
  }
  return true;
}

namespace {

// The kernels' hyper-parameters of one update: the group's settings, this
// step's lr and multiplier (grad_stats() checked every chunk: finite).
kernels::AdamParams adam_params(const OptimizerConfig& o, const GroupSettings& g, int64_t step, float grad_scale,
                                float lr) {
  kernels::AdamParams ap;
  ap.lr = lr;
  ap.beta1 = static_cast<float>(g.beta1);
  ap.beta2 = static_cast<float>(g.beta2);
  ap.eps = static_cast<float>(g.eps);
  ap.weight_decay = static_cast<float>(g.weight_decay);
  ap.decoupled_weight_decay = o.kind == OptimizerKind::kAdamW;
  ap.step = step;
  ap.grad_scale = grad_scale;
  ap.grads_known_finite = true;
  return ap;
}

kernels::LionParams lion_params(const GroupSettings& g, float grad_scale, float lr) {
  kernels::LionParams lp;
  lp.lr = lr;
  lp.beta1 = static_cast<float>(g.beta1);
  lp.beta2 = static_cast<float>(g.beta2);
  lp.weight_decay = static_cast<float>(g.weight_decay);
  lp.grad_scale = grad_scale;
  lp.grads_known_finite = true;
  return lp;
}

kernels::SgdParams sgd_params(const OptimizerConfig& o, const GroupSettings& g, int64_t step, float grad_scale,
                              float lr) {
  kernels::SgdParams sp;
  sp.lr = lr;
  sp.momentum = static_cast<float>(g.momentum);
  sp.dampening = static_cast<float>(o.dampening);
  sp.weight_decay = static_cast<float>(g.weight_decay);
  sp.nesterov = o.nesterov;
  sp.step = step;
  sp.grad_scale = grad_scale;
  sp.grads_known_finite = true;
  return sp;
}

// The CUDA kernels on the compute stream (the legacy default stream, where
// LibTorch computes): the chunk manager orders later copies after them.
#if defined(STRATA_HAVE_CUDA_KERNELS)
kernels::cuda::DeviceSpans device_spans(const kernels::OptimSpans& s) {
  kernels::cuda::DeviceSpans d;
  d.n = s.n;
  d.master = s.master;
  d.grad = s.grad;
  d.exp_avg = s.state0;
  d.exp_avg_sq = s.state1;
  d.param_copy = s.param_copy;
  return d;
}
#endif

}  // namespace

void StepPipeline::update_param(ManagedParam& p, const kernels::OptimSpans& s, float grad_scale, float lr,
                                bool on_cuda) {
  const OptimizerConfig& o = ctx_.optimizer;
  const GroupSettings& g = ctx_.groups[p.group];
  p.steps += 1;
  if (s.n == 0) return;
#if defined(STRATA_HAVE_CUDA_KERNELS)
  const DType copy_dtype = s.param_copy != nullptr ? s.param_dtype : DType::kFloat32;
#else
  STRATA_ASSERT(!on_cuda, "a CUDA update without CUDA kernels: place_device_families refuses that");
#endif
  switch (o.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: {
      const kernels::AdamParams ap = adam_params(o, g, p.steps, grad_scale, lr);
#if defined(STRATA_HAVE_CUDA_KERNELS)
      if (on_cuda) {
        const kernels::cuda::DeviceSpans d = device_spans(s);
        kernels::cuda::multi_tensor_adam(ap, s.grad_dtype, copy_dtype, &d, 1, nullptr, nullptr);
        return;
      }
#endif
      kernels::adam_step(ap, s);
      return;
    }
    case OptimizerKind::kLion: {
      const kernels::LionParams lp = lion_params(g, grad_scale, lr);
#if defined(STRATA_HAVE_CUDA_KERNELS)
      if (on_cuda) {
        kernels::cuda::lion_step(lp, s.grad_dtype, copy_dtype, device_spans(s), nullptr);
        return;
      }
#endif
      kernels::lion_step(lp, s);
      return;
    }
    case OptimizerKind::kSgd: {
      const kernels::SgdParams sp = sgd_params(o, g, p.steps, grad_scale, lr);
      kernels::OptimSpans spans = s;
      if (sp.momentum == 0.0f) spans.state0 = nullptr;  // a group without momentum keeps no buffer
#if defined(STRATA_HAVE_CUDA_KERNELS)
      if (on_cuda) {
        kernels::cuda::sgd_step(sp, s.grad_dtype, copy_dtype, device_spans(spans), nullptr);
        return;
      }
#endif
      kernels::sgd_step(sp, spans);
      return;
    }
  }
}

// Note [Reading the next family ahead]
// While family i is pinned and updated, family i+1's step members that are
// not on host are read. When the host tier is full (the model state far
// beyond memory, every step), the read makes room as any move does,
// evicting the host's least recently used chunks: family i's are pinned,
// and family i+1's own members already on host are touched first, so the
// victims are chunks needed later than i+1 (gradients of families further
// on, which backward touched long ago) or not this step (parameters already
// updated). An eviction the update of i+1 would have made on demand is made
// earlier, on the copy engine, while the kernel runs: the same bytes move,
// and the disk works during the update instead of between updates. A
// read-ahead that cannot make room fails quietly; the pin retries it.
void StepPipeline::read_family_ahead(size_t index, std::vector<offload::CopyTicket>& ahead) {
  memory::ChunkManager& mgr = *ctx_.mgr;
  const memory::FamilyId f = ctx_.families[index];
  std::vector<ChunkId> members = ctx_.step_members(f);
  if (update_overwrites_param(f)) {  // Note [Parameters the update overwrites]: not read
    members.erase(std::find(members.begin(), members.end(), ctx_.step_param(f)));
  }
  for (ChunkId c : members) {
    if (mgr.chunk(c).resident_on(Tier::kHost)) mgr.access(c, Tier::kHost);  // most recently used: not a victim
  }
  ctx_.read_ahead(members, ahead, /*only_into_free=*/false);
}

void StepPipeline::update_on_host(const std::vector<size_t>& order, float grad_scale, const std::vector<float>& lrs,
                                  std::vector<offload::CopyTicket>& ahead, double& waited,
                                  const std::function<void(size_t)>& done) {
  for (size_t k = 0; k < order.size(); ++k) {
    update_family(order[k], Tier::kHost, grad_scale, lrs, [&] {
      if (k + 1 < order.size() && ctx_.options.prefetch) read_family_ahead(order[k + 1], ahead);
    }, waited);
    done(k);
  }
}

void StepPipeline::update_split(float grad_scale, const std::vector<float>& lrs,
                                const std::function<void(size_t)>& after) {
  const size_t n = ctx_.families.size();
  std::vector<size_t> host_families;
  for (size_t i = 0; i < n; ++i) {
    if (!optim_on_device_[i] && !updated_early(i)) host_families.push_back(i);  // Note [Updates in backward]
  }
  // One promise per host family, kept by the worker in order; a failure is
  // handed to the family it struck and to every one after it.
  std::vector<std::promise<void>> host_updated(host_families.size());
  double host_waited = 0.0;
  std::vector<offload::CopyTicket> host_ahead;
  std::future<void> host = std::async(std::launch::async, [&] {
    size_t updated = 0;
    try {
      update_on_host(host_families, grad_scale, lrs, host_ahead, host_waited, [&](size_t k) {
        host_updated[k].set_value();
        updated = k + 1;
      });
    } catch (...) {
      for (size_t k = updated; k < host_families.size(); ++k) host_updated[k].set_exception(std::current_exception());
    }
  });
  // Device families here, while the host ones run; then every family's
  // `after` in order, each once its update is done.
  std::exception_ptr failure;
  try {
    for (size_t i = 0; i < n; ++i) {
      if (optim_on_device_[i]) update_family(i, Tier::kDevice, grad_scale, lrs, [] {}, ctx_.wait.optimizer);
    }
    size_t k = 0;
    for (size_t i = 0; i < n; ++i) {
      if (updated_early(i)) continue;  // its after() ran in backward
      if (!optim_on_device_[i]) host_updated[k++].get_future().get();  // rethrows the worker's failure
      after(i);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  host.get();  // the worker keeps its failures in the promises; this only waits for it
  EngineContext::settle(host_ahead);
  ctx_.wait.optimizer += host_waited;
  if (failure) std::rethrow_exception(failure);
}

bool StepPipeline::step(double& grad_norm) {
  drain_updates();  // Note [Updates in backward]: what backward handed over is done, or the step's
  if (update_error_) {  // a family updated, then its write-back could not start
    const std::exception_ptr failed = std::exchange(update_error_, nullptr);
    abandon_backward();
    std::rethrow_exception(failed);
  }
  const EngineOptions& options = ctx_.options;
  const kernels::GradStats total = grad_stats();
  if (!total.finite) {
    skipped_ += 1;
    clean_steps_ = 0;
    if (options.precision == DType::kFloat16) {
      const double next = std::max(scale_ * options.loss_scale.backoff, options.loss_scale.min_scale);
      STRATA_LOG(kInfo, "fp16 gradients overflowed at loss scale {}: step skipped, scale now {}", scale_, next);
      scale_ = next;
    } else {
      const int early = updated_in_backward();
      STRATA_LOG(kWarn, "gradients hold inf or nan in a {} run: step skipped{}", dtype_name(options.precision),
                 early == 0 ? std::string()
                            : fmt::format(", except the {} chunk families update_in_backward had updated already "
                                          "(their gradients were finite)", early));
    }
    EngineContext::settle(early_);
    end_backward();
    sink_.zero();
    return false;
  }
  grad_norm = std::sqrt(total.sum_sq) * unscale();
  const double multiplier = this->multiplier(grad_norm);

  const std::vector<memory::FamilyId>& families = ctx_.families;
  std::vector<float> lrs(ctx_.groups.size());  // each group's lr for this step: base x schedule
  for (size_t g = 0; g < lrs.size(); ++g) lrs[g] = static_cast<float>(current_lr(g));
  std::vector<offload::CopyTicket> ahead, behind;
  // After family i's update, in family order on this thread: its write-back
  // to NVMe and its parameter gather.
  const auto after = [&](size_t i) {
    if (optim_on_nvme_[i]) {
      for (ChunkId c : ctx_.optim_members(families[i])) behind.push_back(ctx_.mgr->prefetch(c, Tier::kNvme));
    }
    if (gathers_ != nullptr) {
      gathers_->start(families[i]);
      gathers_->finish(1);  // the previous family's gather overlapped this family's update
    }
  };
  try {
    if (std::find(optim_on_device_.begin(), optim_on_device_.end(), true) != optim_on_device_.end()) {
      update_split(static_cast<float>(multiplier), lrs, after);
    } else {
      std::vector<size_t> all;  // what backward did not update (Note [Updates in backward])
      for (size_t i = 0; i < families.size(); ++i) {
        if (!updated_early(i)) all.push_back(i);
      }
      update_on_host(all, static_cast<float>(multiplier), lrs, ahead, ctx_.wait.optimizer,
                     [&](size_t k) { after(all[k]); });
    }
    if (gathers_ != nullptr) gathers_->finish(0);
  } catch (...) {
    try {
      if (gathers_ != nullptr) gathers_->finish(0);
    } catch (...) {  // the first failure is the one reported
    }
    EngineContext::settle(ahead);
    EngineContext::settle(early_);
    for (auto& t : behind) t.wait();
    abandon_backward();
    throw;
  }
  EngineContext::settle(ahead);
  EngineContext::settle(early_);  // started before backward; the accesses above waited for them (counted) or retried them
  for (auto& t : behind) offload::CopyEngine::wait(t);  // a failed write-back is the step's error
  STRATA_LOG(kDebug, "optimizer step {}: {} of {} chunk families updated in backward, the rest after it",
             optimizer_steps_ + 1, updated_in_backward(), families.size());
  end_backward();
  previous_norm_ = grad_norm;
  sink_.zero();
  optimizer_steps_ += 1;
  if (options.precision == DType::kFloat16 && ++clean_steps_ >= options.loss_scale.growth_interval) {
    scale_ *= options.loss_scale.growth_factor;
    clean_steps_ = 0;
  }
  return true;
}

}  // namespace strata::parallel
