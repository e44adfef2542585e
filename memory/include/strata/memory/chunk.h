#pragma once
// Chunk and ChunkFamily: the unit of memory the runtime moves, shards and updates.
//
// A chunk is one flat buffer of one dtype holding many tensors at element
// offsets (ChunkLayout). Tensors of a family are registered together; the
// family's chunks share one layout: the parameter chunk in compute precision,
// the fp32 master chunk (only when the compute precision is not fp32), the
// gradient chunk (or the parameter chunk reused after backward, Gemini's
// reuse_fp16_chunk) and the fp32 optimizer-state chunks. The ChunkManager owns
// every chunk and its payload; everything else holds ids.
//
// Invariants: a chunk's payload lives on at most one tier at a time (an
// nvme copy kept beside it is not its payload: Note [Clean copies on NVMe]
// in chunk_manager.h); a chunk with any tensor in COMPUTE is never moved,
// evicted or released.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/offload/device_event.h"
#include "strata/memory/chunk_layout.h"
#include "strata/memory/eviction_policy.h"
#include "strata/memory/tensor_state.h"
#include "strata/memory/types.h"

namespace strata::memory {

using FamilyId = int32_t;

enum class ChunkRole : uint8_t {
  kParam = 0,       // compute-precision parameters (fp32, bf16 or fp16)
  kMaster = 1,      // fp32 master weights; only for bf16/fp16 parameters
  kGrad = 2,        // gradients
  kOptimState = 3,  // fp32 optimizer state (Adam m, v; momentum), indexed by role_index
};
const char* chunk_role_name(ChunkRole role);

struct TensorSpec {
  std::string name;
  int64_t numel = 0;
};

// Note [Sharded chunk families]
// Under ZeRO each of N ranks keeps 1/N of some of a family's chunks: the
// elements [rank * S, (rank + 1) * S) of the family layout, S =
// capacity / N (ShardLayout). A shard chunk has a layout of its own with one
// slot covering the whole shard. Stage 1 shards the optimizer state and the
// fp32 master (their chunks are shard chunks); stage 2 adds a gradient shard
// chunk beside the full gradient chunk, which then only collects gradients
// during backward until they are reduce-scattered into the shard; stage 3
// adds a parameter shard chunk, and the full parameter chunk becomes
// "gathered": a transient copy assembled from every rank's shard for the
// operators that use it. A gathered chunk is never evicted (its payload is
// not state; moving it down a tier would only waste bandwidth, and its
// lifetime must follow the same operator sequence on every rank): its owner
// releases it.
struct ShardSpec {
  int rank = 0;        // this rank; the manager's world_size is N
  bool optim = false;  // optimizer state and master weights (stage >= 1)
  bool grad = false;   // a gradient shard chunk (stage >= 2)
  bool param = false;  // a parameter shard chunk; the parameter chunk is gathered (stage 3)
};

struct FamilySpec {
  DType param_dtype = DType::kFloat32;
  /// fp32 optimizer-state chunks per family: 2 for Adam/AdamW, 1 for SGD
  /// with momentum or Lion, 0 for plain SGD.
  int optim_states = 0;
  /// false: gradients reuse the parameter chunk after backward.
  bool separate_grad = true;
  /// Gradient dtype; unset means the parameter dtype.
  std::optional<DType> grad_dtype;
  /// ZeRO sharding, see Note [Sharded chunk families].
  ShardSpec shard;
};

class Chunk {
 public:
  ChunkId id() const noexcept { return id_; }
  FamilyId family() const noexcept { return family_; }
  ChunkRole role() const noexcept { return role_; }
  int role_index() const noexcept { return role_index_; }
  DType dtype() const noexcept { return dtype_; }
  const ChunkLayout& layout() const noexcept { return *layout_; }
  int64_t capacity_elems() const noexcept { return layout_->capacity_elems; }
  size_t payload_bytes() const noexcept;
  /// Bytes this chunk occupies on a tier: the payload rounded to kChunkAlignment.
  size_t alloc_bytes() const noexcept;

  /// Where the payload is; nullopt when it has none (never materialised, or released).
  std::optional<Tier> location() const noexcept { return location_; }
  bool resident_on(Tier tier) const noexcept { return location_ == tier; }

  size_t num_tensors() const noexcept { return states_.size(); }
  TensorState state(size_t slot) const;
  int compute_count() const noexcept { return compute_count_; }
  /// Holds one rank's shard of the family layout (Note [Sharded chunk families]).
  bool shard() const noexcept { return shard_; }
  /// A transient full copy gathered from shards: never evicted, released by its owner.
  bool gathered() const noexcept { return gathered_; }
  /// False while any tensor is in COMPUTE.
  bool movable() const noexcept { return compute_count_ == 0; }
  /// Resident on device or host, with the nvme copy it was read from kept
  /// in the store (Note [Clean copies on NVMe] in chunk_manager.h).
  bool nvme_copy_kept() const noexcept { return nvme_kept_; }

  /// "chunk 3 (param bf16 of family 1, 4.00 MiB, on host)".
  std::string describe() const;

 private:
  friend class ChunkManager;
  ChunkId id_ = 0;
  FamilyId family_ = 0;
  ChunkRole role_ = ChunkRole::kParam;
  int role_index_ = 0;
  DType dtype_ = DType::kFloat32;
  std::shared_ptr<const ChunkLayout> layout_;
  std::optional<Tier> location_;
  void* ptr_ = nullptr;  // payload on device or host; the store holds nvme payloads
  // On nvme: the store's read-only view of the payload, when it can map one
  // (Note [Parameters on NVMe stay readable] in chunk_manager.h).
  std::shared_ptr<const void> nvme_view_;
  std::vector<TensorState> states_;
  int compute_count_ = 0;
  bool busy_ = false;  // part of the move in progress: never an eviction candidate
  // On the device tier: the event of the last device work on the payload,
  // the operator that used it last (Note [Copy streams and events]) or the
  // copy that brought it (Note [Arrivals on the device]); copies out of it
  // and the reuse of its memory wait for it.
  offload::DeviceEvent last_use_;
  bool shard_ = false;
  bool gathered_ = false;
  // Resident on device or host, with the copy it was read from still on
  // nvme, unchanged or not (Note [Clean copies on NVMe] in chunk_manager.h).
  bool nvme_kept_ = false;
};

struct ChunkFamily {
  FamilyId id = 0;
  std::shared_ptr<const ChunkLayout> layout;
  std::vector<std::string> tensor_names;  // parallel to layout->slots
  ChunkId param = -1;
  std::optional<ChunkId> master;
  ChunkId grad = -1;  // == param when the gradient reuses the parameter chunk
  std::vector<ChunkId> optim_states;
  /// ZeRO (Note [Sharded chunk families]): this rank's shard of the gradient
  /// (stage >= 2) and of the parameters (stage 3).
  std::optional<ChunkId> grad_shard;
  std::optional<ChunkId> param_shard;

  /// Every distinct chunk of the family.
  std::vector<ChunkId> members() const;
};

/// Where a registered tensor landed.
struct TensorPlacement {
  FamilyId family = 0;
  size_t slot = 0;
  int64_t offset = 0;  // elements from the start of every chunk of the family
  int64_t numel = 0;
};

struct Registration {
  std::vector<FamilyId> families;
  std::vector<TensorPlacement> tensors;  // parallel to the registered list
  ChunkSizePlan plan;
};

}  // namespace strata::memory
