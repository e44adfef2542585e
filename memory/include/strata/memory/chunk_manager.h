#pragma once
// ChunkManager: owns every chunk and its payload, on three budgeted tiers.
//
// It registers tensors into chunk families, makes chunks resident on a tier
// and releases them, and evicts through an EvictionPolicy when a tier would go
// over budget: device -> host -> nvme (see Note [Eviction cascade]). Budgets
// are hard limits: tier_stats(t).used never exceeds the budget, and a request
// that eviction cannot satisfy throws strata::Error naming the tier, the bytes
// requested, the budget and what is resident, and changes nothing it could not
// complete (no chunk loses its payload).
//
// Thread safety: every public member may be called from any thread. The
// manager's lock guards its state but is released while bytes are copied, so
// moves of different chunks overlap with each other and with compute. A chunk
// being moved is "busy": it is never an eviction candidate, and every call
// that would read it, pin it or move it again waits until the move is done
// (counted as a stall). prefetch() starts a move on the copy engine.
//
// Note [Eviction cascade]
// Making room on a tier evicts one chunk at a time to the next lower tier
// until the request fits. Making room there may in turn evict from it, so a
// device request can push a host chunk to nvme. Chunks taking part in the
// move in progress are marked busy and are never candidates, so a cascade
// cannot evict the chunk it is making room for. nvme <-> device moves are
// direct: they stream through the NVMe store's staging blocks (Note [Streamed
// transfers] in nvme_store.h), so they need no room on host. A move reserves and allocates the
// destination (so both copies count against their budgets while the bytes
// move), copies with the lock released, and only then frees the source: when
// the copy fails, the source is still the valid payload. When every chunk on a
// full tier is busy or pinned, a request waits for moves leaving or arriving on
// that tier and fails only if none is in flight.
//
// Note [Arrivals on the device]
// A host -> device move queues its copy on the device's copy stream and makes
// the compute stream wait for the copy's event (DeviceMemory::compute_wait);
// the thread that asked does not wait for the bytes. On a GPU the operators
// queued next run after the copy, and access() returns at once; on the
// emulated device the compute stream is the calling thread, so it waits
// there. The chunk is resident from then on, and its last_use_ is the copy's
// event, so a copy out of it, a write into it or the reuse of its memory
// waits for the arrival as for an operator. The host payload it came from is
// the copy's source: it stays allocated, and counted against the host budget,
// until the event completes (host_frees_). Completed ones are given back at
// the next access, move or release; a host tier short of room waits for the
// oldest before it evicts anything. A copy that fails surfaces where the
// compute stream waits (a strata::Error on the emulated device; CUDA's
// sticky error on a GPU).
//
// Note [Clean copies on NVMe]
// A parameter chunk is read from nvme more often than it changes: in one
// step the forward, the recomputation of a checkpointed block and the
// backward may each find it evicted, and only the optimizer changes it. So
// when a parameter chunk comes up from nvme, its stored copy stays in the
// store (counted in the nvme tier's `used` and in TierStats::kept, not in
// its chunks), and when the chunk is evicted from host back to nvme with the
// same bytes, nothing is written: the kept copy becomes its payload again
// (MoveStats::nvme_kept_by_role). "The same" is the store's word
// (SwapStore::holds_same: NvmeStore compares the xxh3-64 it recorded for the
// copy with one of the payload, without reading the disk), so no writer of a
// chunk (operators, the optimizer, loads, ZeRO gathers, a user between
// steps) has to mark it changed; a changed chunk, or one leaving the device
// straight for nvme, drops its kept copy and is written as before. Kept
// copies are a cache inside the nvme budget: a request short of nvme room
// drops them before it waits or fails, and
// release() and overwrite() drop a chunk's, as forget_nvme_copy() does for
// a chunk its caller changed (the optimizer, after an update). Only parameter chunks keep one:
// the optimizer's state, masters and gradients change between their reads
// and their next eviction, and hashing them would only cost time.

#include <array>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "strata/memory/chunk.h"
#include "strata/memory/chunk_layout.h"
#include "strata/memory/eviction_policy.h"
#include "strata/memory/swap_store.h"
#include "strata/memory/types.h"
#include "strata/offload/copy_engine.h"
#include "strata/offload/device_memory.h"
#include "strata/offload/host_arena.h"

namespace strata::memory {

struct ChunkManagerOptions {
  TierBudgets budgets;
  /// The device tier's memory; null: offload::make_device_memory() (CUDA if
  /// usable, else emulated in host memory).
  std::shared_ptr<offload::DeviceMemory> device;
  offload::HostArenaOptions host_arena;
  /// The nvme tier; null: no nvme tier (its budget must then be 0).
  std::shared_ptr<SwapStore> nvme;
  /// null: LruPolicy.
  std::unique_ptr<EvictionPolicy> policy;
  /// Ranks a chunk is sharded over (ZeRO); chunk capacities are multiples of it.
  int world_size = 1;
  /// Worker threads of the copy engine that runs prefetches.
  int copy_threads = 2;
};

struct TierStats {
  uint64_t budget = 0;
  uint64_t used = 0;  // bytes of chunk payloads on the tier now
  uint64_t peak = 0;  // highest `used` since construction
  int64_t chunks = 0;
  uint64_t evictions = 0;  // chunks evicted from this tier to make room
  // nvme: of `used`, the copies kept for chunks resident above (Note [Clean copies on NVMe]).
  uint64_t kept = 0;
};

struct MoveStats {
  // [from][to], indexed by Tier.
  std::array<std::array<uint64_t, kNumTiers>, kNumTiers> bytes{};
  std::array<std::array<uint64_t, kNumTiers>, kNumTiers> count{};
  // Moves started (bytes reserved at the destination), finished or not; a
  // failed move is started but never counted in bytes/count.
  std::array<std::array<uint64_t, kNumTiers>, kNumTiers> started_bytes{};
  std::array<std::array<uint64_t, kNumTiers>, kNumTiers> started_count{};
  // Moves made on demand: by the thread that needed the chunk (access(),
  // move()), not by a prefetch on the copy engine, evictions they caused
  // included. The caller waited for every one of these bytes; a prefetch
  // that works turns them into background moves. Unlike stall time, the
  // count depends only on what was prefetched, not on timing.
  std::array<std::array<uint64_t, kNumTiers>, kNumTiers> demand_bytes{};
  // NVMe traffic by the moved chunk's role (ChunkRole): bytes read from and
  // written to the nvme tier, finished moves only.
  std::array<uint64_t, 4> nvme_read_by_role{};
  std::array<uint64_t, 4> nvme_written_by_role{};
  // Of nvme_read_by_role, the bytes read on demand (as demand_bytes).
  std::array<uint64_t, 4> nvme_demand_read_by_role{};
  // Evictions to nvme that wrote nothing: the chunk's kept copy held the
  // same bytes (Note [Clean copies on NVMe]). Not in bytes/count.
  std::array<uint64_t, 4> nvme_kept_by_role{};
  uint64_t stalls = 0;         // calls that waited for a chunk's move in flight
  double stall_seconds = 0.0;  // time spent in those waits
  uint64_t stall_bytes = 0;    // bytes of the chunks those calls waited for
};

/// What moved between two readings of move_stats(): `later` less `earlier`,
/// field by field (every field only grows, so `earlier` must be read first).
MoveStats operator-(const MoveStats& later, const MoveStats& earlier);

class ChunkManager {
 public:
  explicit ChunkManager(ChunkManagerOptions options);
  ~ChunkManager();
  ChunkManager(const ChunkManager&) = delete;
  ChunkManager& operator=(const ChunkManager&) = delete;

  /// Packs `tensors` into families of `chunk_elems`-element chunks (Note [Chunk packing]).
  Registration register_tensors(const std::vector<TensorSpec>& tensors, const FamilySpec& spec,
                                int64_t chunk_elems);
  /// Same, with the chunk size chosen by search_chunk_size over `search`,
  /// whose range is capped at a quarter of the device budget (fp32 elements,
  /// at least 1024): an operator's chunks and the ones being evicted must fit
  /// on the device together, whatever size packs with the least padding.
  Registration register_tensors(const std::vector<TensorSpec>& tensors, const FamilySpec& spec,
                                const ChunkSizeSearch& search);

  const Chunk& chunk(ChunkId id) const;
  const ChunkFamily& family(FamilyId id) const;
  size_t num_chunks() const;
  size_t num_families() const;

  /// Makes the chunk resident on `tier` (device or host) and returns its
  /// payload (a device pointer under CUDA). A chunk without payload is
  /// materialised there, zero-filled. Counts as a use for the policy.
  void* access(ChunkId id, Tier tier);
  /// access() for a caller that overwrites every byte it will read back: a
  /// chunk on another tier is not copied; it gets a zero-filled payload on
  /// `tier` and its old one is dropped (an NVMe copy discarded, nothing
  /// read). A chunk already on `tier` keeps its bytes. If room cannot be
  /// made, it throws and the old payload stays.
  void* overwrite(ChunkId id, Tier tier);
  /// Moves the payload to any tier, nvme included. Not a use for the policy.
  void move(ChunkId id, Tier tier);
  /// Starts move(id, tier) on the copy engine and returns at once. A later
  /// access() of the chunk waits for it (a stall) if it is still in flight.
  offload::CopyTicket prefetch(ChunkId id, Tier tier);
  /// Like prefetch(id, tier) to device or host, but only raises: when the
  /// copy engine gets to it, a chunk already on `tier` or a faster one (an
  /// operator took it to the device meanwhile), or without payload, stays.
  offload::CopyTicket prefetch_up(ChunkId id, Tier tier);
  /// Drops the payload wherever it is. The chunk must have no tensor in COMPUTE.
  void release(ChunkId id);
  /// Tells the policy the chunk will not be used before every chunk used
  /// after this call: where it is resident, it becomes the first to leave
  /// its tier, among the demoted ones as `order` says (EvictionPolicy::on_demote).
  void demote(ChunkId id, Demotion order = Demotion::kLastFirst);
  /// Tells the manager the caller changed the chunk's payload: a copy kept
  /// on nvme for it (Note [Clean copies on NVMe]) is dropped now, which frees
  /// its room and spares the comparison at the chunk's next eviction. Only a
  /// hint: without it that comparison finds the change.
  void forget_nvme_copy(ChunkId id);
  /// Moves one tensor of the chunk through the state machine (tensor_state.h).
  /// Entering COMPUTE needs the payload on device or host, and pins it there.
  void transition(ChunkId id, size_t slot, TensorState to);

  /// The payload on device or host; throws when it is elsewhere or absent.
  void* data(ChunkId id) const;
  /// Copies the payload (payload_bytes()) to host memory, from whichever tier holds it.
  void read(ChunkId id, void* host_dst, size_t bytes) const;
  /// Overwrites the payload (payload_bytes()) from host memory, on the tier that holds it.
  void write(ChunkId id, const void* host_src, size_t bytes);

  /// Lowers (or raises, up to the configured budget) the device or host
  /// tier's budget, evicting idle chunks (policy order) until the tier fits.
  /// Chunks in COMPUTE or in flight cannot leave, so the budget set is at
  /// least the bytes they hold; returns the budget in effect. The engine
  /// shrinks the device budget while activations need the room.
  uint64_t set_budget(Tier tier, uint64_t bytes);

  TierStats tier_stats(Tier tier) const;
  MoveStats move_stats() const;
  const offload::DeviceMemory& device() const { return *device_; }
  const offload::HostArena& host_arena() const { return host_; }
  const EvictionPolicy& policy() const { return *policy_; }
  /// Human summary of what is resident on `tier`, for messages and tools.
  std::string residency_report(Tier tier) const;

  // Note [Parameters on NVMe stay readable]
  // A reader outside the manager (torch::save of an attached module: its
  // pickler reads each parameter's storage directly, no operator the engine
  // could see) must find a parameter's bytes wherever its chunk is. So when a
  // chunk lands on nvme, the manager asks the store for a read-only view of
  // the stored bytes (NvmeStore: an mmap of the chunk's extent) and gives it
  // to the listener as the chunk's address; the engine points parameter
  // storages there. The view is dropped once the listener has seen the
  // chunk's next placement. Reads through it are not checksummed (the
  // manager's own reads are); writes through it fault, as a write to a
  // chunk on no addressable tier always did: operators make chunks resident first.
  //
  /// Called after every change of a chunk's payload (moved, materialised,
  /// released) with the chunk, its new tier (nullopt: none) and its new
  /// address (nullptr for none; on nvme the store's read-only view, or
  /// nullptr when it has none), under the manager's lock: it must not call
  /// back into the manager. The engine re-points parameter storages here.
  using PlacementListener = std::function<void(const Chunk&, std::optional<Tier>, void*)>;
  void set_placement_listener(PlacementListener listener);

 private:
  using Lock = std::unique_lock<std::mutex>;
  Chunk& chunk_locked(ChunkId id);
  const Chunk& chunk_locked(ChunkId id) const;
  void wait_idle(const Chunk& c, Lock& lock) const;
  Registration register_layouts(const std::vector<TensorSpec>& tensors, const FamilySpec& spec,
                                std::vector<ChunkLayout> layouts, const ChunkSizePlan& plan);
  ChunkId new_chunk(FamilyId family, std::shared_ptr<const ChunkLayout> layout, ChunkRole role, int index,
                    DType dtype);
  // access(), and prefetch_up() when `only_up`: then a chunk already on
  // `tier` or a faster one, or without payload, stays where it is.
  void* bring(ChunkId id, Tier tier, bool only_up);
  // prefetch() and prefetch_up(): the same on the copy engine.
  offload::CopyTicket submit_prefetch(ChunkId id, Tier tier, bool only_up);
  void move_locked(Chunk& c, Tier to, Lock& lock);
  void transfer(Chunk& c, Tier to, Lock& lock);
  void materialize(Chunk& c, Tier to, Lock& lock);
  void make_room(Tier tier, size_t bytes, const Chunk& requester, Lock& lock);
  void* allocate(Tier tier, size_t bytes);
  /// allocate(), zero-filled; nothing allocated when the fill fails.
  void* allocate_zeroed(Tier tier, size_t bytes);
  /// `host_after`: on host, the payload is given back only once it completes
  /// (the copy reading it, Note [Arrivals on the device]).
  /// `keep_nvme_copy`: an nvme payload stays in the store as the chunk's
  /// kept copy (Note [Clean copies on NVMe]) instead of being discarded.
  void free_payload(Chunk& c, const offload::DeviceEvent& host_after = {}, bool keep_nvme_copy = false) noexcept;
  // Note [Clean copies on NVMe]: whether a chunk read from nvme keeps its copy there.
  bool keeps_nvme_copy(const Chunk& c) const noexcept;
  // A chunk on host whose kept copy holds its bytes goes back to nvme without
  // a write (the lock released while the store compares); false, changing
  // nothing, when the bytes differ.
  bool return_to_kept_copy(Chunk& c, Lock& lock);
  void drop_kept_copy(Chunk& c) noexcept;
  // Drops the kept copy of a chunk not being moved; false when none is left.
  bool drop_a_kept_copy();
  /// Gives back the host payloads whose copies completed; with `wait`, first
  /// waits (the lock released) for the oldest one. False when there were none.
  bool settle_host_frees(Lock& lock, bool wait);
  void account(Tier tier, int64_t bytes, int64_t chunks);
  void placed(Chunk& c) const;
  std::string residency_report_locked(Tier tier) const;

  mutable std::mutex mu_;
  mutable std::condition_variable idle_;  // a move finished
  TierBudgets budgets_;
  std::shared_ptr<offload::DeviceMemory> device_;
  offload::HostArena host_;
  std::shared_ptr<SwapStore> nvme_;
  std::unique_ptr<EvictionPolicy> policy_;
  int world_size_;
  std::vector<std::unique_ptr<Chunk>> chunks_;
  std::vector<ChunkFamily> families_;
  std::array<TierStats, kNumTiers> stats_{};
  std::array<uint64_t, kNumTiers> outgoing_bytes_{};  // bytes of the moves in flight leaving each tier
  std::array<int, kNumTiers> incoming_{};  // moves in flight arriving on each tier
  mutable MoveStats moves_;
  PlacementListener placement_listener_;
  struct HostFree {
    void* ptr;
    size_t bytes;
  };
  offload::EventGated<HostFree> host_frees_;  // Note [Arrivals on the device]
  std::unique_ptr<offload::CopyEngine> copier_;  // last: its jobs use everything above
};

}  // namespace strata::memory
