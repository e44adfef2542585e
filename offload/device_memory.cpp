#include "strata/offload/device_memory.h"

#include <cstdlib>
#include <cstring>

#include "strata/core/error.h"
#include "strata/offload/cuda_runtime.h"
#include "strata/offload/host_arena.h"

namespace strata::offload {

namespace {

class EmulatedDeviceMemory final : public DeviceMemory {
 public:
  EmulatedDeviceMemory() : arena_(HostArenaOptions{/*pin=*/false, std::nullopt, 4096}) {}

  DeviceKind kind() const noexcept override { return DeviceKind::kEmulated; }
  std::string name() const override { return "emulated in host memory"; }
  size_t alignment() const noexcept override { return arena_.alignment(); }
  void* allocate(size_t bytes) override { return arena_.allocate(bytes); }
  void deallocate(void* ptr) noexcept override { arena_.deallocate(ptr); }
  void copy_from_host(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void fill_zero(void* ptr, size_t bytes) override { std::memset(ptr, 0, bytes); }
  bool host_accessible() const noexcept override { return true; }

 private:
  HostArena arena_;
};

class CudaDeviceMemory final : public DeviceMemory {
 public:
  CudaDeviceMemory(int index, std::string device_name) : index_(index), device_name_(std::move(device_name)) {}

  DeviceKind kind() const noexcept override { return DeviceKind::kCuda; }
  int index() const noexcept override { return index_; }
  std::string name() const override { return "cuda:" + std::to_string(index_) + " (" + device_name_ + ")"; }
  size_t alignment() const noexcept override { return 256; }  // cudaMalloc's documented minimum
  void* allocate(size_t bytes) override { return cuda::device_malloc(index_, bytes); }
  void deallocate(void* ptr) noexcept override { cuda::device_free(index_, ptr); }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    cuda::copy_host_to_device(index_, dst, src, bytes);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    cuda::copy_device_to_host(index_, dst, src, bytes);
  }
  void fill_zero(void* ptr, size_t bytes) override { cuda::device_memset_zero(index_, ptr, bytes); }
  bool host_accessible() const noexcept override { return false; }

 private:
  int index_;
  std::string device_name_;
};

}  // namespace

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
