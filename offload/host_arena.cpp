#include "strata/offload/host_arena.h"

#include <jemalloc/jemalloc.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <cstring>
#include <fstream>
#include <string>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/core/log.h"
#include "strata/offload/extent_allocator.h"
#include "strata/offload/cuda_runtime.h"
#include "strata/offload/topology.h"

// Note [The process heap keeps its freed pages]
// Linking strata makes jemalloc the process's malloc, so LibTorch's own
// tensors (activations, gradients before they reach their chunk, matmul
// outputs) come from its default arenas. By default those return freed
// pages to the kernel within seconds (dirty_decay_ms 10000, then muzzy), and
// a training step allocates the same sizes again every step, so each step
// faulted its working memory back in page by page. On this project's VMs a
// page fault is expensive: plain LibTorch on examples/gpt's 128x4 model took
// 119.5-121.9 ms a step with the default and 59.8 ms with freed pages kept,
// strata at a quarter of the model state on the device 1.23-1.32x of it
// against 1.03x, and the resident compute floor of `strata bench scale`
// fell 4x (docs/scale.md). So the default here keeps freed pages for
// reuse: resident memory stays at the heap's peak, which every step
// reaches anyway. MALLOC_CONF in the environment still overrides it (read
// after this string). The host arena is not affected: it never hands pages
// back through jemalloc's decay (Note [Resident memory within the tier]).
// The string lives in this file because every program with chunk memory
// links it: in a file of its own, the static library's member holding it
// would never be pulled into the link (nothing in strata refers to it).
const char* malloc_conf = "dirty_decay_ms:-1,muzzy_decay_ms:-1";

namespace strata::offload {

uint64_t transparent_huge_page_bytes() {
  std::ifstream enabled("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes;
  if (!std::getline(enabled, modes) || modes.find("[never]") != std::string::npos) return 0;
  std::ifstream size("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
  uint64_t bytes = 0;
  if (!(size >> bytes) || bytes == 0 || (bytes & (bytes - 1)) != 0) return 0;
  return bytes;
}

// See Note [Host memory from extent hooks]. `hooks` must stay the first member:
// jemalloc hands the hook functions the extent_hooks_t pointer it was given,
// and they cast it back to the Impl.
namespace {

// CUDA's page-locking (cudaHostRegister), for arenas on a machine with a device.
class CudaPinner final : public HostPinner {
 public:
  bool pin(void* ptr, size_t bytes) noexcept override { return cuda::host_register(ptr, bytes); }
  void unpin(void* ptr, size_t) noexcept override { cuda::host_unregister(ptr); }
};

}  // namespace

struct HostArena::Impl {
  extent_hooks_t hooks{};
  HostArenaOptions options;
  HostPinner* pinner = nullptr;  // null: nothing is page-locked
  unsigned arena = 0;
  bool arena_created = false;
  bool bind_numa = false;
  unsigned numa_node = 0;

  std::mutex mutex;
  struct Mapping {
    size_t bytes;
    bool pinned;
  };
  std::map<uintptr_t, Mapping> mappings;  // base address -> mapping
  uint64_t mapped_bytes = 0;
  bool all_pinned = true;
  bool all_bound = true;
  std::atomic<uint64_t> allocated_bytes{0};

  // Note [Large chunks from one reservation]: unpinned, allocations of at
  // least kLargeBytes come from address space reserved once; Note [Huge
  // pages for large chunks]: those that round up to whole huge pages by at
  // most 1/kMostHugeRounding of their size from a second reservation backed
  // by transparent huge pages.
  static constexpr size_t kLargeBytes = size_t{1} << 20;
  static constexpr uint64_t kMostHugeRounding = 16;
  static constexpr uint64_t kReserveBytes = uint64_t{1} << 40;  // 1 TiB of addresses, no memory
  struct Region {
    char* base = nullptr;
    uint64_t align = 0;
    std::optional<ExtentAllocator> extents;
  };
  bool large_tried = false;
  Region small_pages, huge_pages;
  struct Live {
    Region* region;
    Extent extent;
  };
  std::unordered_map<void*, Live> large_live;
  uint64_t large_live_bytes = 0;  // the extents of large_live
  uint64_t huge_live_bytes = 0;   // those in huge_pages
  // Note [Resident memory within the tier]: the reservations' ranges that
  // may be resident (handed out since last released), by address: start -> end, merged.
  std::map<uint64_t, uint64_t> resident;
  uint64_t resident_bytes = 0;
  uint64_t released_bytes = 0;
  // Note [Pinned ranges from the reservation]: page-locked ranges, start ->
  // end, each one extent's (live or freed); and whether every large chunk so far was.
  std::map<uint64_t, uint64_t> pinned_ranges;
  uint64_t pinned_bytes = 0;
  uint64_t pins = 0;
  bool large_all_pinned = true;

  // Undoes the registrations overlapping [begin, end) (freed extents' only).
  void unpin_overlapping(uint64_t begin, uint64_t end) noexcept {
    auto it = pinned_ranges.upper_bound(begin);
    if (it != pinned_ranges.begin() && std::prev(it)->second > begin) --it;
    while (it != pinned_ranges.end() && it->first < end) {
      pinner->unpin(reinterpret_cast<void*>(it->first), it->second - it->first);
      pinned_bytes -= it->second - it->first;
      it = pinned_ranges.erase(it);
    }
  }

  // Page-locks extent [begin, end) unless it is so already.
  void pin_extent(uint64_t begin, uint64_t end) {
    const auto it = pinned_ranges.find(begin);
    if (it != pinned_ranges.end() && it->second == end) return;  // a freed chunk's range, reused as it was
    unpin_overlapping(begin, end);
    ++pins;
    if (!pinner->pin(reinterpret_cast<void*>(begin), end - begin)) {
      large_all_pinned = false;
      return;
    }
    pinned_ranges.emplace(begin, end);
    pinned_bytes += end - begin;
  }

  void add_resident(uint64_t begin, uint64_t end) {
    auto it = resident.upper_bound(begin);
    if (it != resident.begin() && std::prev(it)->second >= begin) --it;
    while (it != resident.end() && it->first <= end) {  // overlapping or touching: absorb
      begin = std::min(begin, it->first);
      end = std::max(end, it->second);
      resident_bytes -= it->second - it->first;
      it = resident.erase(it);
    }
    resident.emplace(begin, end);
    resident_bytes += end - begin;
  }

  // Releases the resident pages of free range [begin, end) (addresses), at
  // most `want` bytes of them (in whole units of `align`), from the top;
  // returns the bytes released.
  uint64_t release(uint64_t begin, uint64_t end, uint64_t want, uint64_t align) {
    uint64_t done = 0;
    while (done < want) {
      auto it = resident.lower_bound(end);  // the first range starting at or above `end`
      if (it == resident.begin()) break;
      --it;
      if (it->second <= begin) break;
      const uint64_t lo = std::max(it->first, begin), hi = std::min(it->second, end);
      const uint64_t from = hi - std::min(hi - lo, round_up(want - done, align));
      if (pinner != nullptr) unpin_overlapping(from, hi);  // a page-locked page cannot be released
      if (madvise(reinterpret_cast<void*>(from), hi - from, MADV_DONTNEED) != 0) {
        STRATA_LOG(kWarn, "host arena: madvise(MADV_DONTNEED) of {} failed ({}); the arena stays above its "
                   "resident limit", format_bytes(hi - from), std::strerror(errno));
        break;
      }
      const uint64_t first = it->first, last = it->second;
      resident.erase(it);
      if (first < from) resident.emplace(first, from);
      if (hi < last) resident.emplace(hi, last);
      resident_bytes -= hi - from;
      done += hi - from;
      end = from;
    }
    return done;
  }

  // Brings the resident bytes back within the limit by releasing free
  // ranges, highest first, so low addresses (where first fit allocates)
  // stay warm; the huge-page region's first, whose pages fault back in 512
  // at a time.
  // jemalloc's own mappings (small chunks, the arena's metadata) count too.
  void release_over_limit() {
    const auto over = [&] { return mapped_bytes + resident_bytes > options.resident_limit; };
    if (options.resident_limit == 0 || !over()) return;
    for (Region* r : {&huge_pages, &small_pages}) {
      if (!r->extents) continue;
      const auto& free = r->extents->free_in(0);
      for (auto it = free.rbegin(); it != free.rend() && over(); ++it) {
        const uint64_t begin = reinterpret_cast<uint64_t>(r->base) + it->first;
        released_bytes +=
            release(begin, begin + it->second, mapped_bytes + resident_bytes - options.resident_limit, r->align);
      }
    }
  }

  void reserve(Region& r, uint64_t align, bool huge) {
    void* base = mmap(nullptr, kReserveBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (base == MAP_FAILED) return;
    if (huge && madvise(base, kReserveBytes, MADV_HUGEPAGE) != 0) {
      munmap(base, kReserveBytes);
      return;
    }
    // 4 KiB extents stay in 4 KiB pages where the kernel's mode is "always":
    // a huge page would make a whole 2 MiB resident for a part handed out.
    if (!huge) madvise(base, kReserveBytes, MADV_NOHUGEPAGE);
    r.base = static_cast<char*>(base);
    r.align = align;
    r.extents.emplace(std::vector<uint64_t>{kReserveBytes}, align);
  }

  // From a reservation, or nullptr to use jemalloc (pinned arenas, small
  // sizes, no reservation, or none of it fits).
  void* allocate_large(size_t bytes) {
    if (bytes < kLargeBytes) return nullptr;
    std::lock_guard<std::mutex> lock(mutex);
    if (!large_tried) {
      large_tried = true;
      reserve(small_pages, options.alignment, false);
      // Pinned arenas keep 4 KiB pages (Note [Pinned ranges from the reservation]).
      const uint64_t huge = options.huge_pages && pinner == nullptr ? transparent_huge_page_bytes() : 0;
      if (huge >= options.alignment && huge <= (size_t{8} << 20)) reserve(huge_pages, huge, true);
    }
    Region* region = &small_pages;
    uint64_t rounded = round_up(bytes, options.alignment);
    const uint64_t whole = huge_pages.extents ? round_up(bytes, huge_pages.align) : 0;
    if (huge_pages.extents && bytes >= huge_pages.align && (whole - bytes) * kMostHugeRounding <= bytes) {
      // Whole huge pages, unless their rounding could take the live
      // extents past the limit even with every free range released.
      if (options.resident_limit == 0 || mapped_bytes + large_live_bytes + whole <= options.resident_limit) {
        region = &huge_pages;
        rounded = whole;
      }
    }
    if (!region->extents) return nullptr;
    const std::optional<Extent> e = region->extents->allocate(rounded);
    if (!e) return nullptr;
    void* ptr = region->base + e->offset;
    large_live.emplace(ptr, Live{region, *e});
    large_live_bytes += e->bytes;
    if (region == &huge_pages) huge_live_bytes += e->bytes;
    const uint64_t begin = reinterpret_cast<uint64_t>(ptr);
    if (pinner != nullptr) pin_extent(begin, begin + e->bytes);
    add_resident(begin, begin + e->bytes);
    release_over_limit();
    allocated_bytes += e->bytes;
    return ptr;
  }
  bool free_large(void* ptr) noexcept {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = large_live.find(ptr);
    if (it == large_live.end()) return false;
    const Live& l = it->second;
    allocated_bytes -= l.extent.bytes;
    large_live_bytes -= l.extent.bytes;
    if (l.region == &huge_pages) huge_live_bytes -= l.extent.bytes;
    try {
      l.region->extents->free(l.extent);
    } catch (...) {  // cannot happen: the extent was handed out once
    }
    large_live.erase(it);
    return true;
  }

  static Impl* from(extent_hooks_t* h) { return reinterpret_cast<Impl*>(h); }

  // The mapping that contains [addr, addr+size), or nullptr.
  const std::pair<const uintptr_t, Mapping>* find_mapping(uintptr_t addr, size_t size) {
    auto it = mappings.upper_bound(addr);
    if (it == mappings.begin()) return nullptr;
    --it;
    if (addr + size > it->first + it->second.bytes) return nullptr;
    return &*it;
  }

  static void* hook_alloc(extent_hooks_t* h, void* new_addr, size_t size, size_t alignment, bool* zero,
                          bool* commit, unsigned /*arena_ind*/) {
    if (new_addr != nullptr) return nullptr;  // no in-place growth: always a fresh mapping
    Impl* self = from(h);
    alignment = std::max<size_t>(alignment, 4096);
    const size_t span = size + alignment;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;  // jemalloc turns this into a failed mallocx
    const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (base + alignment - 1) & ~(uintptr_t{alignment} - 1);
    if (aligned > base) munmap(raw, aligned - base);
    const uintptr_t end = base + span;
    if (end > aligned + size) munmap(reinterpret_cast<void*>(aligned + size), end - (aligned + size));
    void* ptr = reinterpret_cast<void*>(aligned);

    bool bound = false;
    if (self->bind_numa) bound = bind_to_numa_node(ptr, size, self->numa_node);
    const bool pinned = self->pinner != nullptr && self->pinner->pin(ptr, size);
    {
      std::lock_guard<std::mutex> lock(self->mutex);
      self->mappings[aligned] = Mapping{size, pinned};
      self->mapped_bytes += size;
      self->all_pinned = self->all_pinned && pinned;
      self->all_bound = self->all_bound && bound;
    }
    *zero = true;  // fresh anonymous pages
    *commit = true;
    return ptr;
  }

  // Opt out of returning memory: jemalloc retains the extent for reuse, and
  // the mapping (with its registration) lives until the arena is destroyed.
  static bool hook_dalloc(extent_hooks_t*, void*, size_t, bool, unsigned) { return true; }
  static void hook_destroy(extent_hooks_t*, void*, size_t, bool, unsigned) {}
  static bool hook_split(extent_hooks_t*, void*, size_t, size_t, size_t, bool, unsigned) { return false; }
  static bool hook_merge(extent_hooks_t* h, void* a, size_t size_a, void* b, size_t size_b, bool, unsigned) {
    Impl* self = from(h);
    std::lock_guard<std::mutex> lock(self->mutex);
    const auto* ma = self->find_mapping(reinterpret_cast<uintptr_t>(a), size_a);
    const auto* mb = self->find_mapping(reinterpret_cast<uintptr_t>(b), size_b);
    return !(ma != nullptr && ma == mb);  // false = merged; only within one mapping
  }

  void release_mappings() noexcept {
    for (const auto& [base, m] : mappings) {
      if (m.pinned) pinner->unpin(reinterpret_cast<void*>(base), m.bytes);
      munmap(reinterpret_cast<void*>(base), m.bytes);
    }
    mappings.clear();
    mapped_bytes = 0;
  }
};

HostArena::HostArena(HostArenaOptions options) : impl_(std::make_unique<Impl>()) {
  STRATA_CHECK(options.alignment >= 4096 && (options.alignment & (options.alignment - 1)) == 0,
               "host arena alignment must be a power of two of at least 4096 bytes, got ", options.alignment);
  impl_->options = options;
  if (options.pin) {
    static CudaPinner cuda_pinner;
    impl_->pinner = options.pinner ? options.pinner.get() : (cuda::probe().devices.empty() ? nullptr : &cuda_pinner);
  }
  impl_->hooks.alloc = &Impl::hook_alloc;
  impl_->hooks.dalloc = &Impl::hook_dalloc;
  impl_->hooks.destroy = &Impl::hook_destroy;
  impl_->hooks.split = &Impl::hook_split;
  impl_->hooks.merge = &Impl::hook_merge;
  // commit/decommit/purge stay null: mappings are always committed and never purged.

  const MachineTopology& topo = machine_topology();
  impl_->numa_node = options.numa_node.value_or(current_numa_node());
  impl_->bind_numa = topo.numa_nodes.size() > 1;

  extent_hooks_t* hooks = &impl_->hooks;
  size_t size = sizeof(impl_->arena);
  const int rc = mallctl("arenas.create", &impl_->arena, &size, &hooks, sizeof(hooks));
  STRATA_CHECK(rc == 0, "jemalloc could not create a host arena: mallctl(arenas.create) returned ", rc, " (",
               std::strerror(rc), ")");
  impl_->arena_created = true;
}

HostArena::~HostArena() {
  if (!impl_ || !impl_->arena_created) return;
  const uint64_t live = impl_->allocated_bytes.load();
  if (live != 0) {
    // Destroying the arena would unmap memory still in use; leak it instead.
    STRATA_LOG(kError, "host arena {} destroyed with {} bytes still allocated; its memory is leaked",
               impl_->arena, live);
    impl_.release();
    return;
  }
  const std::string cmd = "arena." + std::to_string(impl_->arena) + ".destroy";
  const int rc = mallctl(cmd.c_str(), nullptr, nullptr, nullptr, 0);
  if (rc != 0) {
    STRATA_LOG(kError, "mallctl({}) failed: {}; host arena memory is leaked", cmd, std::strerror(rc));
    impl_.release();
    return;
  }
  impl_->release_mappings();
  if (impl_->pinner != nullptr) impl_->unpin_overlapping(0, UINT64_MAX);
  for (const Impl::Region* r : {&impl_->small_pages, &impl_->huge_pages}) {
    if (r->base != nullptr) munmap(r->base, Impl::kReserveBytes);
  }
}

void* HostArena::allocate(size_t bytes) {
  if (void* ptr = impl_->allocate_large(bytes)) return ptr;
  const size_t align = impl_->options.alignment;
  const size_t rounded = std::max<size_t>(static_cast<size_t>(round_up(bytes, align)), align);
  void* ptr = mallocx(rounded, MALLOCX_ALIGN(align) | MALLOCX_ARENA(impl_->arena) | MALLOCX_TCACHE_NONE);
  STRATA_CHECK(ptr != nullptr, "host memory exhausted: could not allocate ", rounded,
               " bytes from the strata host arena (mapped so far: ", impl_->mapped_bytes,
               " bytes); lower the host budget or free memory");
  impl_->allocated_bytes += sallocx(ptr, MALLOCX_TCACHE_NONE);
  return ptr;
}

void HostArena::deallocate(void* ptr) noexcept {
  if (ptr == nullptr || impl_->free_large(ptr)) return;
  impl_->allocated_bytes -= sallocx(ptr, MALLOCX_TCACHE_NONE);
  dallocx(ptr, MALLOCX_TCACHE_NONE);
}

size_t HostArena::alignment() const noexcept { return impl_->options.alignment; }
unsigned HostArena::arena_index() const noexcept { return impl_->arena; }

HostArenaStats HostArena::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  HostArenaStats s;
  s.mapped_bytes = impl_->mapped_bytes + impl_->resident_bytes;
  s.released_bytes = impl_->released_bytes;
  s.huge_page_bytes = impl_->huge_live_bytes;
  s.allocated_bytes = impl_->allocated_bytes.load();
  s.mappings = impl_->mappings.size();
  s.pinned = impl_->pinner != nullptr && !impl_->mappings.empty() && impl_->all_pinned && impl_->large_all_pinned;
  s.pins = impl_->pins;
  s.pinned_bytes = impl_->pinned_bytes;
  s.numa_bound = !impl_->mappings.empty() && impl_->all_bound;
  s.numa_node = impl_->numa_node;
  return s;
}

std::string jemalloc_version() {
  const char* version = nullptr;
  size_t size = sizeof(version);
  if (mallctl("version", &version, &size, nullptr, 0) != 0 || version == nullptr) return "unknown";
  return version;
}

}  // namespace strata::offload
