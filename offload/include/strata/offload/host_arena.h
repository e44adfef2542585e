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
//
// Note [Large chunks from one reservation]
// Chunks come in many sizes and go in any order, and the arena never gives
// memory back. jemalloc coalesces freed large extents lazily, so a freed
// 100 MiB extent beside a freed 150 MiB one does not serve the next 256 MiB
// chunk: a new mapping does, and resident memory grows past the most ever
// live (a 3B-parameter run went from a 12 GiB host budget to 24 GB resident
// and was killed). So when the arena
// does not pin (no CUDA device), allocations of 1 MiB and more come from an
// ExtentAllocator (first fit, lowest address, freed neighbours merged at
// once) over 1 TiB of address space reserved once with MAP_NORESERVE: only
// pages handed out are ever touched, and low addresses are reused first, so
// resident memory stays near the peak of live bytes. Pinned arenas too
// (Note [Pinned ranges from the reservation]). Purging freed pages (madvise)
// was tried instead: every chunk read then faulted its pages in again, and
// steps ran 4x slower on this machine.
//
// Note [Resident memory within the tier]
// First fit still fragments: 107 chunk families of many sizes, coming and
// going, left holes no later chunk fitted, and a 3B-parameter run touched
// 13.47 GiB of the reservation for a 12 GiB host tier, which its budget
// never allowed. So the arena keeps the ranges it may hold resident (every
// extent handed out since its pages were last released) and, given a
// `resident_limit` (the chunk manager passes the tier's budget), releases
// free ranges (madvise MADV_DONTNEED, highest addresses first) whenever an
// allocation takes the resident bytes past it. Live bytes never exceed the
// budget (the chunk manager's accounting), so released free pages always
// bring the arena back within it; a released page that is handed out again
// faults in as a zero page, a cost paid only when fragmentation would
// otherwise have grown memory. Pinned arenas are bounded the same way
// (Note [Pinned ranges from the reservation]).
//
// Note [Pinned ranges from the reservation]
// A pinned arena (a CUDA machine) once took its chunks from jemalloc's
// mappings, each page-locked whole, and never gave a page back: the
// fragmentation above then grew it past the tier, with nothing to release.
// Now its large chunks come from the same reservation, in 4 KiB pages, and
// each extent handed out is page-locked exactly (one cudaHostRegister
// over the extent, so a copy never spans two registrations). The
// registration is kept when the chunk is freed: the next chunk of the same
// size lands at the same address (first fit; a family's chunks come back
// each step), and finds it registered. A registration overlapping a new
// extent, or a free range the resident limit releases, is undone first
// (cudaHostUnregister, then madvise): a page-locked page cannot be
// released. Every registration holds one extent, live or freed, so the
// ones a release or a new extent overlaps are always freed ones.
// HostArenaOptions::pinner page-locks: CUDA's by default, mlock in the
// tests, which then run this path without a GPU.
// The arena is separate from the process heap: a leak or overrun elsewhere in
// the process does not land in chunk memory, and chunk churn does not
// fragment the heap LibTorch allocates from.
//
// Note [Huge pages for large chunks]
// At its budget the host tier turns over its whole contents every step (a
// 3B-parameter run reads and writes about 21 GiB a step through 12 GiB),
// and fragmentation makes the resident limit release free ranges that the
// next chunks then fault back in: 16.3 million page faults in a three-step
// 3B run, 126 s of system time, every chunk read faulting its pages in one
// 4 KiB page at a time on a virtual machine where a fault is expensive. So
// chunks that fill whole huge pages (2 MiB here, from sysfs) but for at
// most 1/16 of their size (every chunk of 32 MiB and more) come from a
// second reservation advised MADV_HUGEPAGE, in whole huge pages: a chunk
// faults in 512 times less often, and releasing a free range gives back
// whole huge pages, so the resident accounting stays exact. That run then
// took 548 thousand faults and 55 s of system time, and its steady steps
// 29-43 s instead of 69-76 s (both with OPENBLAS_NUM_THREADS=1; docs/scale.md). The rounding to whole huge
// pages (less than one huge page a chunk, at most 1/16 of it) is resident
// and counts against the limit, so it is the one way past it: the live
// chunks' rounding, when live bytes fill the limit (the 3B run's peak RSS
// was the same +13.02 GiB as with 4 KiB pages). A chunk whose rounding
// alone would take the live extents past the limit takes 4 KiB pages.
// Pinned arenas (CUDA machines) and kernels without transparent huge
// pages keep 4 KiB pages.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace strata::offload {

/// How a pinned arena page-locks host memory (Note [Pinned ranges from the
/// reservation]). Calls come in pairs, unpin(p, n) after pin(p, n) for the
/// same range, under the arena's lock.
class HostPinner {
 public:
  virtual ~HostPinner() = default;
  /// Page-locks [ptr, ptr + bytes); false: it could not (the memory stays usable, pageable).
  virtual bool pin(void* ptr, size_t bytes) noexcept = 0;
  virtual void unpin(void* ptr, size_t bytes) noexcept = 0;
};

struct HostArenaOptions {
  /// Page-lock mappings with cudaHostRegister when a CUDA device is usable.
  bool pin = true;
  /// With `pin`: what page-locks; null: CUDA's cudaHostRegister when a CUDA
  /// device is usable, else nothing is pinned.
  std::shared_ptr<HostPinner> pinner;
  /// NUMA node to bind to; unset: the node of the creating thread. Binding
  /// happens only on machines with more than one node.
  std::optional<unsigned> numa_node;
  /// Allocation alignment; a power of two, at least 4 KiB (O_DIRECT, pages).
  size_t alignment = 4096;
  /// The most bytes the arena may hold resident (mapped_bytes: live and
  /// freed allocations, and jemalloc's own mappings), less the live chunks'
  /// rounding to huge pages; 0: no limit (Note [Resident memory within the
  /// tier], Note [Huge pages for large chunks], Note [Pinned ranges from the
  /// reservation]).
  uint64_t resident_limit = 0;
  /// Unpinned: chunks that fill whole transparent huge pages but for at
  /// most 1/16 of their size in such pages, where the kernel offers them
  /// (Note [Huge pages for large chunks]).
  bool huge_pages = true;
};

struct HostArenaStats {
  uint64_t mapped_bytes = 0;     // may be resident: jemalloc's mappings, and the reservation's ranges not released
  uint64_t released_bytes = 0;   // freed ranges of the reservation given back to the OS so far (resident_limit)
  uint64_t allocated_bytes = 0;  // live allocations (usable sizes)
  uint64_t huge_page_bytes = 0;  // of those, in the transparent huge pages' reservation
  uint64_t mappings = 0;
  bool pinned = false;           // every mapping and large chunk so far was page-locked
  uint64_t pins = 0;             // page-locking calls so far (a freed chunk's range reused as it was makes none)
  uint64_t pinned_bytes = 0;     // page-locked now, live and freed
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

/// The transparent huge page size the kernel hands a region advised
/// MADV_HUGEPAGE (sysfs), or 0 when it hands none (mode "never", no THP).
uint64_t transparent_huge_page_bytes();

/// The linked jemalloc's version string (mallctl "version").
std::string jemalloc_version();

}  // namespace strata::offload
