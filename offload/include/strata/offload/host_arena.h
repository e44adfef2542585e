#pragma once
// HostArena: page-aligned host memory from a dedicated jemalloc arena.
//
// Note [Host memory from extent hooks]
// Chunk buffers are large and long-lived, and on a CUDA machine they must be
// page-locked so copies run at full PCIe/NVLink speed. cudaHostRegister costs
// about a millisecond per call and must see whole mappings, so registering per
// allocation (or per jemalloc extent, which jemalloc splits and merges freely)
// is wrong. Instead the arena gets its own extent hooks: every mapping it
// takes from the OS is mmap'ed once, bound to a NUMA node (hwloc, when the
// machine has more than one) and registered with CUDA (when a device exists),
// and it is kept until the arena is destroyed. jemalloc then carves chunks out
// of these mappings; freed chunks return to the arena, not to the OS, exactly
// like PyTorch's CachingHostAllocator keeps pinned blocks. Merges are refused
// across mappings so an extent never spans two registrations.
// The arena is separate from the process heap: a leak or overrun elsewhere in
// the process does not land in chunk memory, and chunk churn does not
// fragment the heap LibTorch allocates from.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace strata::offload {

struct HostArenaOptions {
  /// Page-lock mappings with cudaHostRegister when a CUDA device is usable.
  bool pin = true;
  /// NUMA node to bind to; unset: the node of the creating thread. Binding
  /// happens only on machines with more than one node.
  std::optional<unsigned> numa_node;
  /// Allocation alignment; a power of two, at least 4 KiB (O_DIRECT, pages).
  size_t alignment = 4096;
};

struct HostArenaStats {
  uint64_t mapped_bytes = 0;     // taken from the OS (retained until destruction)
  uint64_t allocated_bytes = 0;  // live allocations (usable sizes)
  uint64_t mappings = 0;
  bool pinned = false;           // every mapping so far was page-locked
  bool numa_bound = false;       // every mapping so far was bound to numa_node
  unsigned numa_node = 0;
};

class HostArena {
 public:
  explicit HostArena(HostArenaOptions options = {});
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  /// Returns `bytes` (rounded up to the alignment) of uninitialised memory.
  /// Throws strata::Error when the OS refuses the mapping.
  void* allocate(size_t bytes);
  void deallocate(void* ptr) noexcept;

  size_t alignment() const noexcept;
  HostArenaStats stats() const;
  unsigned arena_index() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The linked jemalloc's version string (mallctl "version").
std::string jemalloc_version();

}  // namespace strata::offload
