#include "strata/memory/chunk_manager.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/core/log.h"

namespace strata::memory {

namespace {

// Wakes the waiters of `cv` when it goes out of scope (when `armed`), however the scope ends.
struct NotifyOnExit {
  bool armed;
  std::condition_variable& cv;
  ~NotifyOnExit() {
    if (armed) cv.notify_all();
  }
};

// Marks a chunk as part of the move in progress for the guard's lifetime.
class BusyGuard {
 public:
  explicit BusyGuard(bool& flag) : flag_(flag), previous_(flag) { flag_ = true; }
  ~BusyGuard() { flag_ = previous_; }
  BusyGuard(const BusyGuard&) = delete;
  BusyGuard& operator=(const BusyGuard&) = delete;

 private:
  bool& flag_;
  bool previous_;
};

// True on a copy-engine thread while it runs a prefetch: its moves (and the
// evictions they cause) are not on demand (MoveStats::demand_bytes).
thread_local bool t_in_prefetch = false;
struct PrefetchScope {
  PrefetchScope() { t_in_prefetch = true; }
  ~PrefetchScope() { t_in_prefetch = false; }
};

struct AlignedFree {
  void operator()(void* p) const noexcept { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<void, AlignedFree>;

AlignedBuffer aligned_buffer(size_t alignment, size_t bytes) {
  void* p = std::aligned_alloc(alignment, round_up(bytes, alignment));
  STRATA_CHECK(p != nullptr, "could not allocate a ", format_bytes(bytes), " staging buffer");
  return AlignedBuffer(p);
}

// Note [Resident memory within the tier]: the host arena holds no more
// resident than the host tier's budget, unless told otherwise.
offload::HostArenaOptions host_arena_options(offload::HostArenaOptions options, uint64_t host_budget) {
  if (options.resident_limit == 0) options.resident_limit = host_budget;
  return options;
}

std::vector<int64_t> numels_of(const std::vector<TensorSpec>& tensors) {
  std::vector<int64_t> numels;
  numels.reserve(tensors.size());
  for (const TensorSpec& t : tensors) numels.push_back(t.numel);
  return numels;
}

}  // namespace

ChunkManager::ChunkManager(ChunkManagerOptions options)
    : budgets_(options.budgets),
      device_(options.device ? std::move(options.device) : offload::make_device_memory()),
      host_(host_arena_options(options.host_arena, options.budgets.host)),
      nvme_(std::move(options.nvme)),
      policy_(options.policy ? std::move(options.policy) : std::make_unique<LruPolicy>()),
      world_size_(options.world_size),
      copier_(std::make_unique<offload::CopyEngine>(std::max(options.copy_threads, 1))) {
  STRATA_CHECK(world_size_ >= 1, "world size must be at least 1, got ", world_size_);
  STRATA_CHECK(budgets_.nvme == 0 || nvme_ != nullptr, "an nvme budget of ", format_bytes(budgets_.nvme),
               " was given but no NVMe store is configured; set the nvme budget to 0 or attach a store");
  if (nvme_) {
    STRATA_CHECK(kChunkAlignment % nvme_->alignment() == 0, "NVMe store ", nvme_->describe(), " needs ",
                 nvme_->alignment(), "-byte alignment, more than the ", kChunkAlignment,
                 "-byte chunk alignment");
  }
  for (int t = 0; t < kNumTiers; ++t) stats_[t].budget = budgets_.of(static_cast<Tier>(t));
  device_->set_capacity(budgets_.device);  // the arena enforces the budget too (Note [The device arena])
}

ChunkManager::~ChunkManager() {
  copier_.reset();  // finish prefetches first: they use the chunks below
  for (auto& c : chunks_) {
    drop_kept_copy(*c);
    free_payload(*c);
  }
  while (!host_frees_.empty()) {
    try {
      host_frees_.oldest().synchronize();  // the copy still reads it
    } catch (const std::exception&) {
      // Nothing waits for that copy any more; the memory goes back regardless.
    }
    host_frees_.release_completed([&](const HostFree& f) { host_.deallocate(f.ptr); });
  }
}

// --- registration ----------------------------------------------------------

Registration ChunkManager::register_tensors(const std::vector<TensorSpec>& tensors, const FamilySpec& spec,
                                            int64_t chunk_elems) {
  std::vector<ChunkLayout> layouts = pack_tensors(numels_of(tensors), chunk_elems, world_size_);
  const ChunkSizePlan plan = summarize_packing(layouts, chunk_elems);
  std::lock_guard<std::mutex> lock(mu_);
  return register_layouts(tensors, spec, std::move(layouts), plan);
}

Registration ChunkManager::register_tensors(const std::vector<TensorSpec>& tensors, const FamilySpec& spec,
                                            const ChunkSizeSearch& search) {
  const std::vector<int64_t> numels = numels_of(tensors);
  ChunkSizeSearch s = search;
  s.world_size = world_size_;
  if (budgets_.device > 0) {
    // See register_tensors(): a searched chunk is at most a quarter of the device budget (in fp32 bytes).
    const int64_t cap = std::max<int64_t>(static_cast<int64_t>(budgets_.device / 4 / sizeof(float)), 1024);
    s.max_elems = std::min(s.max_elems, cap);
    s.min_elems = std::min(s.min_elems, s.max_elems);
  }
  const ChunkSizePlan plan = search_chunk_size(numels, s);
  std::vector<ChunkLayout> layouts = pack_tensors(numels, plan.chunk_elems, world_size_);
  std::lock_guard<std::mutex> lock(mu_);
  return register_layouts(tensors, spec, std::move(layouts), plan);
}

Registration ChunkManager::register_layouts(const std::vector<TensorSpec>& tensors, const FamilySpec& spec,
                                            std::vector<ChunkLayout> layouts, const ChunkSizePlan& plan) {
  STRATA_CHECK(spec.optim_states >= 0 && spec.optim_states <= 8, "optimizer state chunks per family must be in "
               "[0, 8], got ", spec.optim_states);
  const ShardSpec& sh = spec.shard;
  const bool sharded = sh.optim || sh.grad || sh.param;
  STRATA_CHECK(sh.rank >= 0 && sh.rank < world_size_, "shard rank ", sh.rank, " is not a rank of the ", world_size_,
               " the chunk manager shards over");
  STRATA_CHECK(!sh.param || sh.grad, "sharding parameters (ZeRO stage 3) needs sharded gradients too");
  STRATA_CHECK(!sh.grad || sh.optim, "sharding gradients (ZeRO stage 2) needs sharded optimizer state too");
  STRATA_CHECK(!sharded || spec.separate_grad, "sharded families need a gradient chunk of their own");
  Registration reg;
  reg.plan = plan;
  reg.tensors.resize(tensors.size());
  for (ChunkLayout& layout : layouts) {
    ChunkFamily fam;
    fam.id = static_cast<FamilyId>(families_.size());
    fam.layout = std::make_shared<const ChunkLayout>(std::move(layout));
    for (size_t s = 0; s < fam.layout->slots.size(); ++s) {
      const TensorSlot& slot = fam.layout->slots[s];
      fam.tensor_names.push_back(tensors[slot.tensor_index].name);
      reg.tensors[slot.tensor_index] = TensorPlacement{fam.id, s, slot.offset, slot.numel};
    }
    // See Note [Sharded chunk families]: one slot covering this rank's shard.
    std::shared_ptr<const ChunkLayout> shard;
    if (sharded) {
      auto l = std::make_shared<ChunkLayout>();
      const auto [begin, end] = fam.layout->shards.range(sh.rank);
      l->capacity_elems = end - begin;
      l->used_elems = std::clamp<int64_t>(fam.layout->used_elems - begin, 0, end - begin);
      l->dedicated = fam.layout->dedicated;
      l->slots.push_back(TensorSlot{-1, 0, end - begin});
      l->shards = ShardLayout{1, end - begin};
      shard = std::move(l);
    }
    const auto layout_for = [&](bool is_shard) { return is_shard ? shard : fam.layout; };
    fam.param = new_chunk(fam.id, fam.layout, ChunkRole::kParam, 0, spec.param_dtype);
    if (spec.param_dtype != DType::kFloat32) {
      fam.master = new_chunk(fam.id, layout_for(sh.optim), ChunkRole::kMaster, 0, DType::kFloat32);
    }
    const DType grad_dtype = spec.grad_dtype.value_or(spec.param_dtype);
    fam.grad = spec.separate_grad ? new_chunk(fam.id, fam.layout, ChunkRole::kGrad, 0, grad_dtype) : fam.param;
    for (int i = 0; i < spec.optim_states; ++i) {
      fam.optim_states.push_back(new_chunk(fam.id, layout_for(sh.optim), ChunkRole::kOptimState, i, DType::kFloat32));
    }
    if (sh.grad) fam.grad_shard = new_chunk(fam.id, shard, ChunkRole::kGrad, 0, grad_dtype);
    if (sh.param) {
      fam.param_shard = new_chunk(fam.id, shard, ChunkRole::kParam, 0, spec.param_dtype);
      chunks_[fam.param]->gathered_ = true;
    }
    reg.families.push_back(fam.id);
    families_.push_back(std::move(fam));
  }
  return reg;
}

ChunkId ChunkManager::new_chunk(FamilyId family, std::shared_ptr<const ChunkLayout> layout, ChunkRole role,
                                int index, DType dtype) {
  auto c = std::make_unique<Chunk>();
  c->id_ = static_cast<ChunkId>(chunks_.size());
  c->family_ = family;
  c->role_ = role;
  c->role_index_ = index;
  c->dtype_ = dtype;
  c->states_.assign(layout->slots.size(), TensorState::kFree);
  c->shard_ = layout->slots.size() == 1 && layout->slots[0].tensor_index < 0;
  c->layout_ = std::move(layout);
  chunks_.push_back(std::move(c));
  return chunks_.back()->id_;
}

// --- lookup ----------------------------------------------------------------

Chunk& ChunkManager::chunk_locked(ChunkId id) {
  STRATA_CHECK(id >= 0 && static_cast<size_t>(id) < chunks_.size(), "unknown chunk id ", id, " (",
               chunks_.size(), " chunks registered)");
  return *chunks_[id];
}

const Chunk& ChunkManager::chunk_locked(ChunkId id) const {
  return const_cast<ChunkManager*>(this)->chunk_locked(id);
}

const Chunk& ChunkManager::chunk(ChunkId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return chunk_locked(id);
}

const ChunkFamily& ChunkManager::family(FamilyId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_CHECK(id >= 0 && static_cast<size_t>(id) < families_.size(), "unknown chunk family id ", id);
  return families_[id];
}

size_t ChunkManager::num_chunks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return chunks_.size();
}

size_t ChunkManager::num_families() const {
  std::lock_guard<std::mutex> lock(mu_);
  return families_.size();
}

// --- residency -------------------------------------------------------------

void ChunkManager::wait_idle(const Chunk& c, Lock& lock) const {
  if (!c.busy_) return;
  const auto start = std::chrono::steady_clock::now();
  idle_.wait(lock, [&] { return !c.busy_; });
  moves_.stalls += 1;
  moves_.stall_bytes += c.alloc_bytes();
  moves_.stall_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void* ChunkManager::access(ChunkId id, Tier tier) { return bring(id, tier, /*only_up=*/false); }

void* ChunkManager::bring(ChunkId id, Tier tier, bool only_up) {
  Lock lock(mu_);
  STRATA_CHECK(tier != Tier::kNvme, "chunks are accessed on device or host; use move() to offload to nvme");
  Chunk& c = chunk_locked(id);
  settle_host_frees(lock, /*wait=*/false);
  wait_idle(c, lock);
  if (only_up && (!c.location_ || static_cast<int>(*c.location_) <= static_cast<int>(tier))) return c.ptr_;
  move_locked(c, tier, lock);
  policy_->on_access(c.id_, tier);
  return c.ptr_;
}

void* ChunkManager::overwrite(ChunkId id, Tier tier) {
  Lock lock(mu_);
  STRATA_CHECK(tier != Tier::kNvme, "chunks are overwritten on device or host, not on nvme");
  Chunk& c = chunk_locked(id);
  settle_host_frees(lock, /*wait=*/false);
  wait_idle(c, lock);
  if (c.location_ != tier) {
    STRATA_CHECK(c.movable(), "cannot overwrite ", c.describe(), " on ", tier_name(tier), ": ", c.compute_count_,
                 " of its tensors are in COMPUTE elsewhere");
    BusyGuard busy(c.busy_);
    NotifyOnExit notify{true, idle_};
    // Room and zeros first: when either fails, the old payload is still the chunk's.
    const size_t bytes = c.alloc_bytes();
    make_room(tier, bytes, c, lock);
    void* ptr = allocate_zeroed(tier, bytes);
    drop_kept_copy(c);
    free_payload(c);
    c.ptr_ = ptr;
    c.location_ = tier;
    placed(c);
  }
  policy_->on_access(c.id_, tier);
  return c.ptr_;
}

void ChunkManager::move(ChunkId id, Tier tier) {
  Lock lock(mu_);
  Chunk& c = chunk_locked(id);
  settle_host_frees(lock, /*wait=*/false);
  wait_idle(c, lock);
  move_locked(c, tier, lock);
}

offload::CopyTicket ChunkManager::prefetch(ChunkId id, Tier tier) { return submit_prefetch(id, tier, /*only_up=*/false); }

offload::CopyTicket ChunkManager::prefetch_up(ChunkId id, Tier tier) {
  STRATA_CHECK(tier != Tier::kNvme, "prefetch_up raises a chunk to device or host, not to nvme");
  return submit_prefetch(id, tier, /*only_up=*/true);
}

offload::CopyTicket ChunkManager::submit_prefetch(ChunkId id, Tier tier, bool only_up) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    chunk_locked(id);  // validate now, in the caller's thread
  }
  // Prefetching to device or host is a use (the chunk is wanted soon), so the
  // policy does not pick it as the next victim.
  return copier_->submit([this, id, tier, only_up] {
    PrefetchScope scope;
    if (tier == Tier::kNvme) {
      move(id, tier);
    } else {
      bring(id, tier, only_up);
    }
  });
}

// Called with the lock held and `c` not busy (or busy by this very move).
void ChunkManager::move_locked(Chunk& c, Tier to, Lock& lock) {
  if (c.location_ == to) return;
  STRATA_CHECK(c.movable(), "cannot move ", c.describe(), " to ", tier_name(to), ": ", c.compute_count_,
               " of its tensors are in COMPUTE; finish the operator (transition to HOLD) first");
  const bool outer = !c.busy_;
  BusyGuard busy(c.busy_);
  NotifyOnExit notify{outer, idle_};  // wake waiters when the outermost move of `c` ends
  if (!c.location_) {
    materialize(c, to == Tier::kNvme ? Tier::kHost : to, lock);
    if (to != Tier::kNvme) return;
  }
  transfer(c, to, lock);
}

void ChunkManager::materialize(Chunk& c, Tier to, Lock& lock) {
  STRATA_ASSERT(to != Tier::kNvme, "chunks are materialised in addressable memory");
  const size_t bytes = c.alloc_bytes();
  make_room(to, bytes, c, lock);
  c.ptr_ = allocate_zeroed(to, bytes);
  c.location_ = to;
  placed(c);
}

void ChunkManager::transfer(Chunk& c, Tier to, Lock& lock) {
  const Tier from = *c.location_;
  STRATA_ASSERT(from != to, "transfer to the tier the chunk is on");
  if (to == Tier::kNvme && c.nvme_kept_) {
    // Note [Clean copies on NVMe]: only a host payload is compared; the device's would need copying out first.
    if (from == Tier::kHost && return_to_kept_copy(c, lock)) return;
    drop_kept_copy(c);
  }
  const size_t bytes = c.alloc_bytes();
  make_room(to, bytes, c, lock);
  // Reserve the destination; from here both copies count against their budgets.
  void* dst = nullptr;
  if (to == Tier::kNvme) {
    account(Tier::kNvme, static_cast<int64_t>(bytes), 1);
  } else {
    dst = allocate(to, bytes);
  }
  outgoing_bytes_[static_cast<int>(from)] += bytes;
  incoming_[static_cast<int>(to)] += 1;
  moves_.started_bytes[static_cast<int>(from)][static_cast<int>(to)] += bytes;
  moves_.started_count[static_cast<int>(from)][static_cast<int>(to)] += 1;
  void* src = c.ptr_;
  const ChunkId key = c.id_;
  const offload::DeviceEvent last_use = c.last_use_;
  offload::DeviceEvent arrival;  // Note [Arrivals on the device]
  std::shared_ptr<const void> view;
  lock.unlock();  // the bytes move without the lock; `c` is busy, so nobody else touches it
  std::exception_ptr failure;
  try {
    if (from == Tier::kDevice && to == Tier::kNvme) {
      // Streamed: block i is written while block i+1 comes off the device.
      nvme_->write_streamed(key, bytes, [&](size_t off, void* block, size_t len) {
        device_->copy_to_host(block, static_cast<const char*>(src) + off, len, last_use);
      });
    } else if (from == Tier::kNvme && to == Tier::kDevice) {
      // Streamed: block i goes to the device while block i+1 is read.
      nvme_->read_streamed(key, bytes, [&](size_t off, const void* block, size_t len) {
        device_->copy_from_host(static_cast<char*>(dst) + off, block, len);
      });
    } else if (to == Tier::kNvme) {
      nvme_->write(key, src, bytes);
    } else if (from == Tier::kNvme) {
      nvme_->read(key, dst, bytes);
    } else if (to == Tier::kDevice) {
      // Note [Arrivals on the device]: the operators wait for the copy, not this thread.
      arrival = device_->copy_from_host_async(dst, src, bytes);
      device_->compute_wait(arrival);
    } else {
      device_->copy_to_host(dst, src, bytes, last_use);  // after the operators that wrote it
    }
    // Note [Parameters on NVMe stay readable]: only parameter chunks back storages.
    if (to == Tier::kNvme && c.role() == ChunkRole::kParam) view = nvme_->view(key);
  } catch (...) {
    failure = std::current_exception();
  }
  lock.lock();
  outgoing_bytes_[static_cast<int>(from)] -= bytes;
  incoming_[static_cast<int>(to)] -= 1;
  if (failure) {
    // The source is untouched and stays the chunk's payload.
    if (to == Tier::kNvme) {
      nvme_->discard(key);
      account(Tier::kNvme, -static_cast<int64_t>(bytes), -1);
    } else {
      // A device destination is reused only after an upload that may still be writing it.
      (to == Tier::kDevice ? device_->deallocate(dst, arrival) : host_.deallocate(dst));
      account(to, -static_cast<int64_t>(bytes), -1);
    }
    idle_.notify_all();
    std::rethrow_exception(failure);
  }
  // A host source goes back once the copy read it; an nvme one may stay as the kept copy.
  free_payload(c, arrival, /*keep_nvme_copy=*/from == Tier::kNvme && keeps_nvme_copy(c));
  c.ptr_ = dst;
  c.location_ = to;
  if (to == Tier::kNvme) c.nvme_view_ = std::move(view);
  c.last_use_ = arrival;
  placed(c);
  moves_.bytes[static_cast<int>(from)][static_cast<int>(to)] += bytes;
  moves_.count[static_cast<int>(from)][static_cast<int>(to)] += 1;
  if (!t_in_prefetch) moves_.demand_bytes[static_cast<int>(from)][static_cast<int>(to)] += bytes;
  if (from == Tier::kNvme) moves_.nvme_read_by_role[static_cast<size_t>(c.role())] += bytes;
  if (from == Tier::kNvme && !t_in_prefetch) moves_.nvme_demand_read_by_role[static_cast<size_t>(c.role())] += bytes;
  if (to == Tier::kNvme) moves_.nvme_written_by_role[static_cast<size_t>(c.role())] += bytes;
  idle_.notify_all();
}

bool ChunkManager::keeps_nvme_copy(const Chunk& c) const noexcept {
  return c.role_ == ChunkRole::kParam && nvme_->compares_copies();
}

bool ChunkManager::return_to_kept_copy(Chunk& c, Lock& lock) {
  const size_t bytes = c.alloc_bytes();
  const void* src = c.ptr_;
  const ChunkId key = c.id_;
  const bool param = c.role_ == ChunkRole::kParam;
  std::shared_ptr<const void> view;
  // `c` is busy (this move), so its payload and its kept copy stay while the lock is released.
  lock.unlock();
  bool same = false;
  try {
    same = nvme_->holds_same(key, src, bytes);
    // Note [Parameters on NVMe stay readable]
    if (same && param) view = nvme_->view(key);
  } catch (...) {
    same = false;  // unknown: written as any other chunk
  }
  lock.lock();
  if (!same) return false;
  free_payload(c);
  stats_[static_cast<int>(Tier::kNvme)].kept -= bytes;
  c.nvme_kept_ = false;
  c.location_ = Tier::kNvme;
  account(Tier::kNvme, 0, 1);
  c.nvme_view_ = std::move(view);
  placed(c);
  moves_.nvme_kept_by_role[static_cast<size_t>(c.role_)] += bytes;
  idle_.notify_all();
  return true;
}

void ChunkManager::drop_kept_copy(Chunk& c) noexcept {
  if (!c.nvme_kept_) return;
  nvme_->discard(c.id_);
  const size_t bytes = c.alloc_bytes();
  stats_[static_cast<int>(Tier::kNvme)].kept -= bytes;
  account(Tier::kNvme, -static_cast<int64_t>(bytes), 0);
  c.nvme_kept_ = false;
  idle_.notify_all();  // room on nvme
}

bool ChunkManager::drop_a_kept_copy() {
  for (auto& c : chunks_) {
    if (!c->nvme_kept_ || c->busy_) continue;  // a busy one's move may be comparing against its copy
    drop_kept_copy(*c);
    return true;
  }
  return false;
}

// Note [Waiting for moves leaving the tier]
// When the moves already leaving a tier will free enough for a request once
// they finish (the optimizer writing back the family it just updated while
// the next one is read ahead), the request waits for them instead of
// evicting another chunk. An eviction then would write a chunk out, on the
// same disk as the moves in flight, that was not in the way a moment later,
// and the chunks left most idle on host in the optimizer's phase are the
// gradients and parameters of the families it updates next: each one evicted
// there is read back within the phase. A move leaving the tier finishes
// without the manager's lock, so the wait cannot deadlock; a failed one
// frees nothing, and the loop then evicts as before.
void ChunkManager::make_room(Tier tier, size_t bytes, const Chunk& requester, Lock& lock) {
  TierStats& s = stats_[static_cast<int>(tier)];
  STRATA_CHECK(tier != Tier::kNvme || nvme_ != nullptr, "cannot place ", requester.describe(),
               " on the nvme tier: no NVMe store is configured; raise the host budget or attach an NVMe store");
  STRATA_CHECK(bytes <= s.budget, tier_name(tier), " budget ", format_bytes(s.budget), " is smaller than ",
               requester.describe(), " (", format_bytes(bytes), "); raise the ", tier_name(tier),
               " budget or lower the chunk size");
  while (s.used + bytes > s.budget) {
    // Sources of copies still in flight to the device go back before anything is evicted.
    if (tier == Tier::kHost && settle_host_frees(lock, /*wait=*/true)) continue;
    // Note [Clean copies on NVMe]: kept copies are a cache, the first room given up.
    if (tier == Tier::kNvme && drop_a_kept_copy()) continue;
    // Note [Waiting for moves leaving the tier]
    if (outgoing_bytes_[static_cast<int>(tier)] > 0 &&
        s.used - outgoing_bytes_[static_cast<int>(tier)] + bytes <= s.budget) {
      idle_.wait(lock);
      continue;
    }
    std::vector<ChunkId> candidates;
    if (tier != Tier::kNvme) {
      for (const auto& c : chunks_) {
        if (c->location_ == tier && c->movable() && !c->busy_ && !c->gathered_) candidates.push_back(c->id_);
      }
    }
    if (candidates.empty() && (outgoing_bytes_[static_cast<int>(tier)] > 0 || incoming_[static_cast<int>(tier)] > 0)) {
      // A move leaving this tier will free its source; one arriving will
      // leave an evictable chunk unless its caller pins it. Both finish
      // without this lock's holder, so waiting cannot deadlock.
      idle_.wait(lock);
      continue;
    }
    STRATA_CHECK(!candidates.empty(), tier_name(tier), " tier cannot fit ", format_bytes(bytes), " for ",
                 requester.describe(), ": budget ", format_bytes(s.budget), ", ", format_bytes(s.used),
                 " resident in ", s.chunks, " chunks, none evictable",
                 tier == Tier::kNvme ? " (nvme is the last tier)" : " (in COMPUTE, being moved or gathered)", ". ",
                 residency_report_locked(tier), ". Raise the ", tier_name(tier),
                 " budget, lower the chunk size, or release chunks");
    const ChunkId victim_id = policy_->choose_victim(tier, candidates);
    Chunk& victim = chunk_locked(victim_id);
    STRATA_ASSERT(victim.location_ == tier && victim.movable() && !victim.busy_, "policy ", policy_->name(),
                  " chose ", victim.describe(), ", which is not an eviction candidate on ", tier_name(tier));
    STRATA_LOG(kDebug, "evicting {} from {} to make room for {}", victim.describe(), tier_name(tier),
               requester.describe());
    move_locked(victim, next_lower_tier(tier), lock);
    s.evictions += 1;
  }
}

void* ChunkManager::allocate(Tier tier, size_t bytes) {
  STRATA_ASSERT(tier != Tier::kNvme, "nvme payloads live in the store");
  void* ptr = tier == Tier::kDevice ? device_->allocate(bytes) : host_.allocate(bytes);
  account(tier, static_cast<int64_t>(bytes), 1);
  return ptr;
}

void* ChunkManager::allocate_zeroed(Tier tier, size_t bytes) {
  void* ptr = allocate(tier, bytes);
  if (tier == Tier::kDevice) {
    try {
      device_->fill_zero(ptr, bytes);
    } catch (...) {
      device_->deallocate(ptr);
      account(tier, -static_cast<int64_t>(bytes), -1);
      throw;
    }
  } else {
    std::memset(ptr, 0, bytes);
  }
  return ptr;
}

void ChunkManager::free_payload(Chunk& c, const offload::DeviceEvent& host_after, bool keep_nvme_copy) noexcept {
  if (!c.location_) return;
  const Tier tier = *c.location_;
  const size_t bytes = c.alloc_bytes();
  int64_t freed = static_cast<int64_t>(bytes);
  switch (tier) {
    case Tier::kDevice: device_->deallocate(c.ptr_, c.last_use_); break;  // reused after its last use
    case Tier::kHost:
      if (host_after.query()) {
        host_.deallocate(c.ptr_);
      } else {
        host_frees_.push(HostFree{c.ptr_, bytes}, host_after);  // still counted (Note [Arrivals on the device])
        freed = 0;
      }
      break;
    case Tier::kNvme:
      if (keep_nvme_copy) {  // Note [Clean copies on NVMe]: still counted, as kept
        stats_[static_cast<int>(Tier::kNvme)].kept += bytes;
        c.nvme_kept_ = true;
        freed = 0;
      } else {
        nvme_->discard(c.id_);
      }
      break;
  }
  account(tier, -freed, -1);
  c.ptr_ = nullptr;
  c.location_.reset();
  c.last_use_ = offload::DeviceEvent();
  policy_->on_leave(c.id_, tier);
}

bool ChunkManager::settle_host_frees(Lock& lock, bool wait) {
  if (host_frees_.empty()) return false;
  if (wait && !host_frees_.oldest().query()) {
    const offload::DeviceEvent oldest = host_frees_.oldest();
    lock.unlock();
    try {
      oldest.synchronize();
    } catch (const std::exception&) {
      // The failed copy is reported where the compute stream waits for it; its source can go.
    }
    lock.lock();
  }
  const bool freed = host_frees_.release_completed([&](const HostFree& f) {
    host_.deallocate(f.ptr);
    account(Tier::kHost, -static_cast<int64_t>(f.bytes), 0);
  });
  if (freed) idle_.notify_all();  // room on host
  return freed;
}

void ChunkManager::set_placement_listener(PlacementListener listener) {
  std::lock_guard<std::mutex> lock(mu_);
  placement_listener_ = std::move(listener);
}

// See Note [Parameters on NVMe stay readable].
void ChunkManager::placed(Chunk& c) const {
  const bool on_nvme = c.location_ == Tier::kNvme;
  void* address = on_nvme ? const_cast<void*>(c.nvme_view_.get()) : c.ptr_;
  if (placement_listener_) placement_listener_(c, c.location_, address);
  if (!on_nvme) c.nvme_view_.reset();
}

void ChunkManager::account(Tier tier, int64_t bytes, int64_t chunks) {
  TierStats& s = stats_[static_cast<int>(tier)];
  s.used = static_cast<uint64_t>(static_cast<int64_t>(s.used) + bytes);
  s.chunks += chunks;
  STRATA_ASSERT(s.used <= s.budget, tier_name(tier), " tier over budget: ", s.used, " > ", s.budget);
  s.peak = std::max(s.peak, s.used);
}

void ChunkManager::demote(ChunkId id, Demotion order) {
  std::lock_guard<std::mutex> lock(mu_);
  const Chunk& c = chunk_locked(id);
  if (c.location_ && *c.location_ != Tier::kNvme) policy_->on_demote(id, *c.location_, order);
}

void ChunkManager::forget_nvme_copy(ChunkId id) {
  Lock lock(mu_);
  Chunk& c = chunk_locked(id);
  wait_idle(c, lock);  // a move in flight may be comparing against the copy
  drop_kept_copy(c);
}

void ChunkManager::release(ChunkId id) {
  Lock lock(mu_);
  Chunk& c = chunk_locked(id);
  settle_host_frees(lock, /*wait=*/false);
  wait_idle(c, lock);
  STRATA_CHECK(c.movable(), "cannot release ", c.describe(), ": ", c.compute_count_,
               " of its tensors are in COMPUTE");
  drop_kept_copy(c);
  free_payload(c);
  placed(c);
  idle_.notify_all();  // space freed: requests waiting for room may proceed
}

void ChunkManager::transition(ChunkId id, size_t slot, TensorState to) {
  Lock lock(mu_);
  Chunk& c = chunk_locked(id);
  const TensorState from = c.state(slot);
  const std::string& name = c.shard_ ? std::string("shard") : families_[c.family_].tensor_names[slot];
  if (!is_legal_transition(from, to)) {
    std::string legal;
    for (int s = 0; s < kNumTensorStates; ++s) {
      if (is_legal_transition(from, static_cast<TensorState>(s))) {
        legal += std::string(legal.empty() ? "" : ", ") + tensor_state_name(static_cast<TensorState>(s));
      }
    }
    STRATA_FAIL("illegal tensor state transition ", tensor_state_name(from), " -> ", tensor_state_name(to),
                " for tensor '", name, "' (slot ", slot, ") of ",
                c.describe(), "; from ", tensor_state_name(from), " only ", legal, " may follow");
  }
  if (to == TensorState::kCompute) {
    wait_idle(c, lock);  // never compute on a half-moved chunk
    STRATA_CHECK(c.location_ == Tier::kDevice || c.location_ == Tier::kHost, "tensor '",
                 name, "' cannot enter COMPUTE: ", c.describe(),
                 " is not resident on device or host; access() it first");
    ++c.compute_count_;
  }
  if (from == TensorState::kCompute) {
    --c.compute_count_;
    // The operators queued so far may still read or write it on the device.
    // Only the last slot's release matters: a chunk with a slot in COMPUTE
    // cannot move or be freed.
    if (c.compute_count_ == 0 && c.location_ == Tier::kDevice) c.last_use_ = device_->compute_event();
  }
  c.states_[slot] = to;
}

// --- payload access ----------------------------------------------------------

void* ChunkManager::data(ChunkId id) const {
  Lock lock(mu_);
  const Chunk& c = chunk_locked(id);
  wait_idle(c, lock);
  STRATA_CHECK(c.location_ == Tier::kDevice || c.location_ == Tier::kHost, "no addressable payload for ",
               c.describe(), "; access() it on device or host first");
  return c.ptr_;
}

void ChunkManager::read(ChunkId id, void* host_dst, size_t bytes) const {
  Lock lock(mu_);
  const Chunk& c = chunk_locked(id);
  wait_idle(c, lock);
  STRATA_CHECK(bytes == c.payload_bytes(), "read of ", bytes, " bytes from ", c.describe(), " whose payload is ",
               c.payload_bytes(), " bytes");
  STRATA_CHECK(c.location_.has_value(), "cannot read ", c.describe(), ": it has no payload");
  switch (*c.location_) {
    case Tier::kDevice: device_->copy_to_host(host_dst, c.ptr_, bytes, c.last_use_); break;
    case Tier::kHost: std::memcpy(host_dst, c.ptr_, bytes); break;
    case Tier::kNvme: {
      // The store reads whole aligned blocks; the staging buffer is transient
      // caller-side memory, outside the tier budgets.
      AlignedBuffer staging = aligned_buffer(nvme_->alignment(), c.alloc_bytes());
      nvme_->read(c.id_, staging.get(), c.alloc_bytes());
      std::memcpy(host_dst, staging.get(), bytes);
      break;
    }
  }
}

void ChunkManager::write(ChunkId id, const void* host_src, size_t bytes) {
  Lock lock(mu_);
  Chunk& c = chunk_locked(id);
  wait_idle(c, lock);
  STRATA_CHECK(bytes == c.payload_bytes(), "write of ", bytes, " bytes to ", c.describe(), " whose payload is ",
               c.payload_bytes(), " bytes");
  STRATA_CHECK(c.location_.has_value(), "cannot write ", c.describe(), ": it has no payload; access() it first");
  switch (*c.location_) {
    case Tier::kDevice: device_->copy_from_host(c.ptr_, host_src, bytes, c.last_use_); break;
    case Tier::kHost: std::memcpy(c.ptr_, host_src, bytes); break;
    case Tier::kNvme: {
      // The store writes the new copy before it frees the old one, so the
      // rewrite needs room for a second copy while it runs.
      BusyGuard busy(c.busy_);
      make_room(Tier::kNvme, c.alloc_bytes(), c, lock);
      account(Tier::kNvme, static_cast<int64_t>(c.alloc_bytes()), 0);
      AlignedBuffer staging = aligned_buffer(nvme_->alignment(), c.alloc_bytes());
      std::memset(static_cast<char*>(staging.get()) + bytes, 0, c.alloc_bytes() - bytes);
      std::memcpy(staging.get(), host_src, bytes);
      try {
        nvme_->write(c.id_, staging.get(), c.alloc_bytes());
      } catch (...) {
        account(Tier::kNvme, -static_cast<int64_t>(c.alloc_bytes()), 0);
        throw;
      }
      account(Tier::kNvme, -static_cast<int64_t>(c.alloc_bytes()), 0);
      break;
    }
  }
}

// --- accounting ----------------------------------------------------------------

uint64_t ChunkManager::set_budget(Tier tier, uint64_t bytes) {
  STRATA_CHECK(tier != Tier::kNvme, "the nvme budget is fixed at construction");
  Lock lock(mu_);
  TierStats& s = stats_[static_cast<int>(tier)];
  bytes = std::min(bytes, budgets_.of(tier));
  while (s.used > bytes) {
    if (tier == Tier::kHost && settle_host_frees(lock, /*wait=*/true)) continue;
    std::vector<ChunkId> candidates;
    for (const auto& c : chunks_) {
      if (c->location_ == tier && c->movable() && !c->busy_ && !c->gathered_) candidates.push_back(c->id_);
    }
    if (candidates.empty()) break;
    Chunk& victim = chunk_locked(policy_->choose_victim(tier, candidates));
    STRATA_LOG(kDebug, "evicting {} from {} to lower its budget to {}", victim.describe(), tier_name(tier),
               format_bytes(bytes));
    move_locked(victim, next_lower_tier(tier), lock);
    s.evictions += 1;
  }
  s.budget = std::max(bytes, s.used);
  if (tier == Tier::kDevice) device_->trim(s.budget);  // room past the budget goes back (Note [The device arena])
  return s.budget;
}

TierStats ChunkManager::tier_stats(Tier tier) const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_[static_cast<int>(tier)];
}

namespace {

// a - b, element by element through nested std::arrays.
template <class T>
T minus(const T& a, const T& b) {
  if constexpr (std::is_arithmetic_v<T>) {
    return a - b;
  } else {
    T d{};
    for (size_t i = 0; i < d.size(); ++i) d[i] = minus(a[i], b[i]);
    return d;
  }
}

}  // namespace

MoveStats operator-(const MoveStats& later, const MoveStats& earlier) {
  MoveStats d;
  d.bytes = minus(later.bytes, earlier.bytes);
  d.count = minus(later.count, earlier.count);
  d.started_bytes = minus(later.started_bytes, earlier.started_bytes);
  d.started_count = minus(later.started_count, earlier.started_count);
  d.demand_bytes = minus(later.demand_bytes, earlier.demand_bytes);
  d.nvme_read_by_role = minus(later.nvme_read_by_role, earlier.nvme_read_by_role);
  d.nvme_written_by_role = minus(later.nvme_written_by_role, earlier.nvme_written_by_role);
  d.nvme_demand_read_by_role = minus(later.nvme_demand_read_by_role, earlier.nvme_demand_read_by_role);
  d.nvme_kept_by_role = minus(later.nvme_kept_by_role, earlier.nvme_kept_by_role);
  d.stalls = minus(later.stalls, earlier.stalls);
  d.stall_seconds = minus(later.stall_seconds, earlier.stall_seconds);
  d.stall_bytes = minus(later.stall_bytes, earlier.stall_bytes);
  return d;
}

MoveStats ChunkManager::move_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return moves_;
}

std::string ChunkManager::residency_report(Tier tier) const {
  std::lock_guard<std::mutex> lock(mu_);
  return residency_report_locked(tier);
}

std::string ChunkManager::residency_report_locked(Tier tier) const {
  constexpr int kListed = 8;
  const TierStats& s = stats_[static_cast<int>(tier)];
  std::string out = std::string("resident on ") + tier_name(tier) + ": " + format_bytes(s.used) + " of " +
                    format_bytes(s.budget) + " in " + std::to_string(s.chunks) + " chunks";
  int listed = 0;
  for (const auto& c : chunks_) {
    if (c->location_ != tier) continue;
    if (listed == kListed) {
      out += ", ...";
      break;
    }
    out += std::string(listed == 0 ? ": " : ", ") + c->describe();
    if (c->compute_count_ > 0) out += " [" + std::to_string(c->compute_count_) + " in COMPUTE]";
    if (c->busy_) out += " [moving]";
    ++listed;
  }
  return out;
}

}  // namespace strata::memory
