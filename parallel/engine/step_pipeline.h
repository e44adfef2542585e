#pragma once
// StepPipeline: the optimizer step over chunk families, and the state it
// keeps between steps: where each family's optimizer state lives (host or
// NVMe, memory::nvme_optim_families), the loss scaler, the learning-rate
// schedule's position, and the reads of NVMe-resident state started before
// backward (Note [The step pipeline]). Each parameter is updated by the fused
// kernel of the configured optimizer with its group's hyper-parameters.

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <utility>
#include <optional>
#include <vector>

#include "../runtime/context.h"
#include "strata/kernels/optim.h"

namespace strata::parallel {

class GradSink;
class StepGathers;

// Note [The step pipeline]
// Before backward, the optimizer state on NVMe starts coming back to host,
// family by family, as far as the host's free bytes allow after reserving
// room for the gradient and parameter chunks (read_state_early), so those
// reads overlap backward. The step visits chunk families in order. With
// family i pinned on host it starts (on the chunk manager's copy engine) the
// reads of family i+1's chunks that are not on host, evicting what the host
// needs least when it is full (Note [Reading the next family ahead]); after
// updating family i it starts the write-back
// to NVMe of its optimizer state when that state lives there. So while the
// kernel updates family i, family i+1 is read and family i-1 written: the
// optimizer waits on NVMe only when the disk is slower than the update.
// Budgets still hold: the reads and write-backs are ordinary chunk moves,
// evicting as they need.
// Note [The optimizer where its state lives]
// With EngineOptions::device_optim_fraction, the first families' optimizer
// state is updated on the device: their step members are pinned there (the
// chunk manager brings what is elsewhere, gradients included) and updated
// by the device kernels: CUDA's on a GPU (Adam/AdamW, Lion, SGD on the
// compute stream), the CPU kernels on the emulated device, whose memory the
// host reads. Meanwhile a worker thread updates the other families on the
// CPU, on host, as ZeRO-Offload does, so the two overlap. The norm and
// overflow check before (grad_stats) and the loss scaler are the same for
// both: one multiplier, one decision to skip. Collectives that follow a
// family's update (ZeRO 1-2 parameter gathers) are issued by the calling
// thread in family order, each once its family is done, whichever thread
// updated it: every rank issues the same sequence (Note [Collectives are
// issued in order]). NVMe-resident state is never on the device list.
// Note [Gradient statistics as families complete]
// The step's global facts (the overflow check, the norm exact clipping
// needs) are sums over every gradient chunk. Taken at the step, they read
// each gradient chunk once, and the update reads it again: a gradient that
// had to leave host memory in backward came back from NVMe twice. So in
// the backward that ends an accumulation, when nothing changes a gradient
// after it arrives (no data-parallel reduction; no user hook before the
// step), the sink counts each family's trainable parameters as their
// gradients arrive, and the family's statistics are taken the moment the
// last one lands, while the sink still holds its chunk on host. Any later
// arrival into that family (a parameter used again, by a reentrant
// recomputation) forgets them, and the step takes whatever is missing
// then, as before. The statistics are the same kernel over the same bytes,
// merged in family order: the step's norm, its clipping and its skip
// decision are bit for bit those of the step-time pass.
// Note [Gradients die with their update]
// A family's gradient chunks are dropped as soon as its update is done,
// not when the step ends (GradSink::zero): nothing reads them after, and
// the next backward materialises them zero-filled as before. Kept until the
// end, they held host room the read-ahead of the next families then took
// from chunks still needed in the phase (the gradients and parameters of
// the families updated later, idle since backward), which were written to
// NVMe and read back before their own update.
// Note [Updated parameters leave first]
// In the optimizer's phase the host is full and its least recently used
// chunks are those backward left: the gradients and parameters of the
// families not yet updated, each needed again within the phase. A family's
// parameter chunk, once updated, is needed only by the next forward, after
// every chunk of the phase; so the step demotes it (ChunkManager::demote)
// and the host evicts updated parameters first, the last updated first
// (forward uses the families in order, so that one is needed last). The
// bytes are the same (an evicted chunk is written now and read later), but
// the read moves from the disk-bound phase to the next forward, where it
// is staged ahead of its operators. Families updated in backward (Note
// [Updates in backward]) come in the reverse order, the last updated needed
// first in forward, so they are demoted to leave the first updated first
// (memory::Demotion::kFirstFirst): with the last-first order, a 3B fp32 run
// read 7.6-11 GiB of parameters back a step for 11 GiB of them.
// Note [Updated optimizer state leaves before parameters]
// A family's optimizer state (and fp32 master in mixed precision), once
// updated, is touched again only by the
// same family's update a step later, after the next forward has used every
// parameter (and, in the step's phase, after the next backward too). Left
// in the recency order it was the most recently used chunk on host, so the
// host evicted the early layers' parameters, idle since forward, before
// it: each step read nearly all the optimizer state back and wrote it out
// again, and read the parameters besides. The step demotes it with
// memory::Demotion::kBeforeAll, ahead of the updated parameters, the last
// updated first: both the phase and the updates in backward take the
// families in the same order every step, so the first updated is the first
// needed again. What the host holds across steps is then optimizer state
// that stays resident, read and written by no step, the residency Note
// [The least traffic of a step] counts on.
// Note [Updates in backward]
// With EngineOptions::update_in_backward, the backward that ends an
// accumulation updates each chunk family the moment its gradients are
// final: the gradient chunk is still on host where the sink wrote it, the
// family's optimizer state was read ahead while the layers after it ran
// backward, and its gradients are dropped after the update, so they never
// go to NVMe and the optimizer's reads and writes overlap backward instead
// of following it. "Final" is learnt, not guessed: a backward counts how
// many times each parameter's gradient arrives, and in the next one a
// family is final once each of its trainable parameters has arrived as
// often as then (a weight shared by two checkpointed blocks arrives twice).
// A family with a parameter that had no gradient then, or one that arrives
// more often now, waits for the step, as do the families updated on the
// device; a gradient that arrives after its family was updated is an error
// naming the parameter (the model uses its parameters differently from
// step to step: set the option false). The first backward only counts. The
// updates run on a thread of their own, in the order families became
// final, so Adam's pass over a family takes the other core while backward
// goes on (the multiplier each gets is fixed when it is handed over, so the
// results do not depend on timing). Backward hands over a family only when
// none is waiting, so at most two families' gradients wait on host for
// their update; a pin that finds no room while that
// thread holds a family pinned waits for it, and a family the thread cannot
// get its chunks for is left to the step, unchanged. A
// parameter some block reads without a gradient (detached) arrives for its
// other uses only: were that block recomputed later in the backward, it
// would read the updated value, so such models need the option off.
// The step's global facts come from the statistics of each family's final
// gradients (Note [Gradient statistics as families complete]): the norm is
// the step's own, taken before each update, so grad_norm and the skip of
// non-finite steps stay. Without clipping nothing else depends on the norm,
// and the results equal the step's bit for bit. With clipping the
// coefficient cannot wait for the last gradient (the relaxed mode): a
// family updated in backward is clipped by the norm as far as it is known,
// the families updated so far, itself included, with their own gradients,
// and the elements still to come at the previous step's norm:
//   norm^2 ~ done_sum_sq + previous_norm^2 x (elements pending / all).
// The last family updated sees nearly the step's own norm, and families the
// step updates see exactly it. Clipping every family by the previous norm
// alone (what a one-step-delayed coefficient is) left the GPT example 7%
// behind the exact mode after 80 steps: after a spike in the norm, the
// spike goes through unclipped and the step after is clipped by it, which
// Adam's second moment, swollen by the spike, turns into steps far too
// small; the estimate follows the spike within the backward it happens in.
// The previous norm is kept in checkpoints, so a resumed run continues as
// the uninterrupted one. One rank holds the whole model then: under tensor
// or pipeline parallelism the other ranks' part of the norm is unknown in
// backward, and clipping with update_in_backward is refused there. A step
// whose gradients hold inf or nan is skipped as before, except the families
// already updated (bf16 and fp32 only; fp16 is refused, since its loss
// scaler skips steps routinely).
class StepPipeline {
 public:
  /// `sink` drops the gradients after a step; `gathers` (ZeRO stages 1-2,
  /// else null) all-gathers each family's updated parameter chunk.
  StepPipeline(EngineContext& ctx, GradSink& sink, StepGathers* gathers);
  ~StepPipeline();
  StepPipeline(const StepPipeline&) = delete;
  StepPipeline& operator=(const StepPipeline&) = delete;

  /// Decides, once the families exist, which keep their optimizer state on NVMe.
  void place_optimizer_state();
  const std::vector<bool>& optim_on_nvme() const { return optim_on_nvme_; }
  /// Families updated on the device (Note [The optimizer where its state lives]).
  const std::vector<bool>& optim_on_device() const { return optim_on_device_; }
  /// Before the backward that ends an accumulation: starts reading the
  /// optimizer state on NVMe back to host, as far as it fits.
  void read_state_early();
  /// Global norm and overflow check of the (reduced) gradients, then the
  /// update of every family. Returns false when the step was skipped for
  /// overflow (fp16: the loss scale backs off). `grad_norm`: unscaled, before clipping.
  bool step(double& grad_norm);

  /// Note [Gradient statistics as families complete]: forgets what was
  /// taken, and (on) takes them from now on as families complete.
  void track_gradients(bool on);
  /// The sink's arrival hook: family `f`'s gradient chunk is pinned on host.
  void gradients_arrived(memory::FamilyId f, bool complete);

  /// Note [Updates in backward]: at the start of the backward that ends an
  /// accumulation, while its gradients are tracked: counts arrivals from
  /// now on, and (`fuse`) updates families in it as they become final.
  void begin_backward(bool fuse);
  /// The sink's settled hook: parameter `index`'s gradient arrived.
  void gradient_settled(size_t index);
  /// After a failed train_step: stops counting, waits for what the updates
  /// in backward started. Never throws.
  void abandon_backward() noexcept;
  /// EngineContext::make_room while updating in backward: a pin that found
  /// no room waits for the update in flight on the updater thread, which
  /// holds chunks pinned, and retries (true); false on that thread itself,
  /// or when no update is in flight.
  bool wait_for_an_update();
  /// The last applied step's global gradient norm, from which the next
  /// step's updates in backward estimate theirs; none before the first.
  std::optional<double> previous_grad_norm() const { return previous_norm_; }
  void restore_previous_grad_norm(std::optional<double> norm) { previous_norm_ = norm; }
  /// How often each parameter's gradient arrived in the last counted
  /// backward (empty: none yet), which decides what the next backward may
  /// update; kept in checkpoints so a resumed run updates as the uninterrupted one.
  const std::vector<int>& gradient_arrivals() const { return expected_; }
  void restore_gradient_arrivals(std::vector<int> arrivals) {
    if (arrivals.size() == ctx_.params.size()) expected_ = std::move(arrivals);
  }
  /// Families the last backward updated.
  int updated_in_backward() const {
    return static_cast<int>(std::count(updated_early_.begin(), updated_early_.end(), true));
  }

  /// Applied optimizer steps: the schedule's position.
  int64_t optimizer_steps() const { return optimizer_steps_; }
  void set_optimizer_steps(int64_t steps) { optimizer_steps_ = steps; }
  /// The lr group `group` uses in the next step: its base lr times the schedule's factor.
  double current_lr(size_t group) const;

  double loss_scale() const { return scale_; }
  int64_t skipped() const { return skipped_; }
  /// The scaler's state, for checkpoints.
  int clean_steps() const { return clean_steps_; }
  void restore_scaler(double scale, int clean_steps, int64_t skipped);

 private:
  kernels::GradStats grad_stats();
  /// The sum of squares of family `f`'s gradients that other ranks of the
  /// tensor group hold too: each part's times (1 - 1/copies) (Note [Clipping
  /// across the tensor group]), its gradient chunk pinned on host.
  double replicated_sum_sq(memory::FamilyId f) const;
  /// Pins family `index`'s step members on `tier` (host, or the device),
  /// calls `pinned_hook`, then updates it there; adds the time the pins
  /// waited to `waited`.
  void update_family(size_t index, Tier tier, float grad_scale, const std::vector<float>& lrs,
                     const std::function<void()>& pinned_hook, double& waited,
                     memory::Demotion updated = memory::Demotion::kLastFirst);
  /// Family `f`'s gradient statistics and the part other tensor ranks hold
  /// too (replicated_sum_sq), its gradient chunk pinned on host.
  std::pair<kernels::GradStats, double> stats_of(memory::FamilyId f) const;
  void update_param(ManagedParam& p, const kernels::OptimSpans& spans, float grad_scale, float lr, bool on_cuda);
  /// Note [Parameters the update overwrites]: family `f`'s update writes
  /// every parameter element of its step parameter chunk on this rank.
  bool update_overwrites_param(memory::FamilyId f) const;
  void place_nvme_families();
  void place_device_families();
  /// Starts reading family `index`'s step members to host, evicting what
  /// the host needs least (Note [Reading the next family ahead]).
  void read_family_ahead(size_t index, std::vector<offload::CopyTicket>& ahead);
  /// Updates the families of `order` on host one after another, reading the
  /// next one's step members ahead while each is pinned; done(k) after the k-th.
  void update_on_host(const std::vector<size_t>& order, float grad_scale, const std::vector<float>& lrs,
                      std::vector<offload::CopyTicket>& ahead, double& waited, const std::function<void(size_t)>& done);
  /// The update of every family, device families on this thread and the
  /// others on a worker; `after(i)` runs here for each family in order once
  /// it is updated.
  void update_split(float grad_scale, const std::vector<float>& lrs, const std::function<void(size_t)>& after);
  /// The mean over micro-steps and ranks, the loss scale undone: what turns
  /// the summed gradients into the step's.
  double unscale() const;
  /// unscale(), and with clipping the coefficient of `norm`.
  double multiplier(double norm) const;
  /// Note [Updates in backward]: hands family `pos` to the updater thread
  /// with the multiplier it is updated by; false when its gradients are not
  /// finite (the step decides). Holds fuse_mu_.
  bool update_early(size_t pos);
  struct EarlyUpdate {
    size_t pos;
    float grad_scale;
  };
  /// The updater thread's loop, and one update on it.
  void run_updates();
  /// `ran`: set once the family's chunks are pinned and the kernel is about to run.
  void update_one(const EarlyUpdate& u, bool& ran);
  /// Waits until the updater thread has done all it was given; families it
  /// could not update (no room, a read that failed: nothing of them
  /// changed) are left to the step.
  void drain_updates() noexcept;
  bool updated_early(size_t pos) const { return pos < updated_early_.size() && updated_early_[pos]; }
  /// Ends what begin_backward started, at the step.
  void end_backward();

  EngineContext& ctx_;
  GradSink& sink_;
  StepGathers* gathers_;
  std::vector<bool> optim_on_nvme_;  // parallel to ctx.families
  std::vector<bool> optim_on_device_;  // parallel to ctx.families
  std::vector<offload::CopyTicket> early_;
  bool track_ = false;
  std::vector<std::optional<kernels::GradStats>> early_stats_;  // by family position
  std::vector<double> early_replicated_;                        // by family position
  double scale_ = 1.0;  // the loss scale
  int clean_steps_ = 0;
  int64_t skipped_ = 0;
  int64_t optimizer_steps_ = 0;
  // Note [Updates in backward]
  std::mutex fuse_mu_;
  bool counting_ = false;  // in a tracked backward, since begin_backward
  bool fusing_ = false;    // and updating families in it
  std::vector<int> arrivals_;   // by parameter index: this backward's arrivals
  std::vector<int> expected_;   // by parameter index: the last counted backward's; empty: none yet
  std::vector<int> first_arrivals_;  // by family position: trainable parameters arrived at least once
  std::vector<int> trainable_;            // by family position: its trainable parameters
  std::vector<int64_t> trainable_elems_;  // and their elements
  std::vector<int> unsettled_;  // by family position: parameters short of their expected arrivals
  std::vector<bool> updated_early_;   // by family position
  std::vector<size_t> order_;  // family positions in the order they became complete, this backward
  static constexpr size_t kNone = static_cast<size_t>(-1);
  std::vector<size_t> next_final_;  // by position: the family complete next in the last counted backward, or kNone
  static constexpr int kNever = std::numeric_limits<int>::max() / 2;  // unsettled_: the step updates it
  double done_sq_ = 0.0;   // with clipping: the gradients' sum of squares of the families updated
  int64_t done_elems_ = 0, all_elems_ = 0;  // and their elements, of all trainable ones
  std::vector<float> early_lrs_;
  std::vector<offload::CopyTicket> early_ahead_, early_behind_;  // the updater thread's
  std::optional<double> previous_norm_;
  // The updater thread (started with the first update in backward) and what it is given.
  std::thread updater_;
  std::thread::id updater_id_;
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<EarlyUpdate> queue_;
  size_t running_ = 0;       // taken from the queue, not done
  uint64_t finished_ = 0;    // updates done or given up, ever
  bool stop_ = false;
  std::vector<size_t> returned_;  // families the updater could not update: the step's
  std::exception_ptr update_error_;  // a failure after a family's kernel ran: the step's error
  double updater_waited_ = 0.0;
};

}  // namespace strata::parallel
