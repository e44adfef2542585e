#include "strata/offload/device_memory.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/offload/copy_engine.h"
#include "strata/offload/cuda_runtime.h"

namespace strata::offload {

namespace {

// A job on an emulated copy stream: complete when its ticket is.
class TicketEvent final : public DeviceEvent::Impl {
 public:
  explicit TicketEvent(CopyTicket ticket) : ticket_(std::move(ticket)) {}
  bool query() const override { return CopyEngine::test(ticket_); }
  void synchronize() const override { CopyEngine::wait(ticket_); }

 private:
  CopyTicket ticket_;
};

// Emulated segments: anonymous mappings, which cost nothing until touched and
// go back to the system when released.
void* map_segment(size_t bytes) {
  return STRATA_SYSCALL(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0),
                        "cannot map ", format_bytes(bytes), " for the emulated device");
}

// Payloads from a DeviceArena over the backing's segments (Note [The device
// arena]); 4 KiB-aligned, what O_DIRECT reads into a payload (and the NVMe
// store's staging blocks) need, beyond cudaMalloc's 256 bytes.
class ArenaDeviceMemory : public DeviceMemory {
 public:
  explicit ArenaDeviceMemory(DeviceArena::Backing backing) : arena_(std::move(backing), 4096) {}
  size_t alignment() const noexcept override { return arena_.alignment(); }
  void* allocate(size_t bytes) override { return arena_.allocate(bytes); }
  void deallocate(void* ptr, const DeviceEvent& after) noexcept override { arena_.deallocate(ptr, after); }
  void set_capacity(uint64_t bytes) override { arena_.set_capacity(bytes); }
  void trim(uint64_t keep) override { arena_.trim(keep); }
  DeviceArenaStats arena_stats() const override { return arena_.stats(); }

 private:
  DeviceArena arena_;
};

class EmulatedDeviceMemory final : public ArenaDeviceMemory {
 public:
  EmulatedDeviceMemory()
      : ArenaDeviceMemory(DeviceArena::Backing{map_segment, [](void* p, size_t bytes) { ::munmap(p, bytes); }}) {}

  DeviceKind kind() const noexcept override { return DeviceKind::kEmulated; }
  std::string name() const override { return "emulated in host memory"; }

  // Each direction is a copy engine with one worker: its jobs run in order, as
  // a stream's. A job first waits for `after` (a stream waiting on an event).
  // A copy with nothing to wait for, on a stream with nothing in flight, is
  // done on the calling thread and returns a complete event: it would run
  // next anyway, and the hand-off to the worker and back is what every
  // synchronous chunk move would otherwise pay.
  DeviceEvent copy_from_host_async(void* dst, const void* src, size_t bytes, const DeviceEvent& after) override {
    return on_stream(to_device_, dst, src, bytes, after);
  }
  DeviceEvent copy_to_host_async(void* dst, const void* src, size_t bytes, const DeviceEvent& after) override {
    return on_stream(to_host_, dst, src, bytes, after);
  }
  void fill_zero(void* ptr, size_t bytes) override { std::memset(ptr, 0, bytes); }
  DeviceEvent compute_event() override { return DeviceEvent(); }  // the caller's work is done when it returns
  void compute_wait(const DeviceEvent& event) override { event.synchronize(); }
  bool host_accessible() const noexcept override { return true; }

 private:
  static DeviceEvent on_stream(CopyEngine& stream, void* dst, const void* src, size_t bytes, const DeviceEvent& after) {
    if (!after.pending() && stream.in_flight() == 0) {
      std::memcpy(dst, src, bytes);
      return DeviceEvent();
    }
    return DeviceEvent(std::make_shared<TicketEvent>(stream.submit([dst, src, bytes, after] {
      after.synchronize();
      std::memcpy(dst, src, bytes);
    })));
  }

  CopyEngine to_device_{1};  // destroyed before the arena (a base): their jobs finish first
  CopyEngine to_host_{1};
};

class CudaDeviceMemory final : public ArenaDeviceMemory {
 public:
  CudaDeviceMemory(int index, std::string device_name)
      : ArenaDeviceMemory(DeviceArena::Backing{[index](size_t bytes) { return cuda::device_malloc(index, bytes); },
                                               [index](void* p, size_t) { cuda::device_free(index, p); }}),
        index_(index),
        device_name_(std::move(device_name)) {}

  DeviceKind kind() const noexcept override { return DeviceKind::kCuda; }
  int index() const noexcept override { return index_; }
  std::string name() const override { return "cuda:" + std::to_string(index_) + " (" + device_name_ + ")"; }
  DeviceEvent copy_from_host_async(void* dst, const void* src, size_t bytes, const DeviceEvent& after) override {
    return cuda::copy_async(index_, dst, src, bytes, /*to_device=*/true, after);
  }
  DeviceEvent copy_to_host_async(void* dst, const void* src, size_t bytes, const DeviceEvent& after) override {
    return cuda::copy_async(index_, dst, src, bytes, /*to_device=*/false, after);
  }
  void fill_zero(void* ptr, size_t bytes) override { cuda::device_memset_zero(index_, ptr, bytes); }
  DeviceEvent compute_event() override { return cuda::record_compute(index_); }
  void compute_wait(const DeviceEvent& event) override { cuda::compute_wait(index_, event); }
  bool host_accessible() const noexcept override { return false; }

 private:
  int index_;
  std::string device_name_;
};

}  // namespace

void DeviceMemory::copy_from_host(void* dst, const void* src, size_t bytes, const DeviceEvent& after) {
  copy_from_host_async(dst, src, bytes, after).synchronize();
}

void DeviceMemory::copy_to_host(void* dst, const void* src, size_t bytes, const DeviceEvent& after) {
  copy_to_host_async(dst, src, bytes, after).synchronize();
}

std::unique_ptr<DeviceMemory> make_emulated_device_memory() { return std::make_unique<EmulatedDeviceMemory>(); }

std::unique_ptr<DeviceMemory> make_cuda_device_memory(int index) {
  const cuda::RuntimeInfo info = cuda::probe();
  STRATA_CHECK(info.compiled, "a CUDA device was requested but strata was built without CUDA; "
                              "rebuild with the CUDA toolkit or use STRATA_DEVICE=emulated");
  STRATA_CHECK(index >= 0 && index < static_cast<int>(info.devices.size()), "CUDA device ", index,
               " requested but ", info.devices.size(), " device(s) are usable",
               info.error.empty() ? "" : " (" + info.error + ")", "; use STRATA_DEVICE=emulated to run without one");
  return std::make_unique<CudaDeviceMemory>(index, info.devices[index].name);
}

std::unique_ptr<DeviceMemory> make_device_memory() {
  const char* env = std::getenv("STRATA_DEVICE");
  const std::string choice = env ? env : "";
  if (choice == "emulated") return make_emulated_device_memory();
  if (choice.rfind("cuda", 0) == 0) {
    int index = 0;
    if (choice.size() > 5 && choice[4] == ':') index = std::atoi(choice.c_str() + 5);
    return make_cuda_device_memory(index);
  }
  STRATA_CHECK(choice.empty() || choice == "auto", "STRATA_DEVICE='", choice,
               "' is not understood; use auto, emulated, cuda or cuda:N");
  const cuda::RuntimeInfo info = cuda::probe();
  if (!info.devices.empty()) return make_cuda_device_memory(0);
  return make_emulated_device_memory();
}

}  // namespace strata::offload
