// Runs on a machine with a CUDA device (tools/gpu_check.sh); skips without one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "strata/offload/cuda_runtime.h"
#include "strata/offload/device_memory.h"
#include "strata/offload/host_arena.h"

namespace strata::offload {
namespace {

bool have_gpu() { return !cuda::probe().devices.empty(); }

TEST(GpuDeviceMemory, RoundTripsThroughTheGpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: " << cuda::probe().error;
  auto dev = make_cuda_device_memory(0);
  EXPECT_EQ(dev->kind(), DeviceKind::kCuda);
  EXPECT_FALSE(dev->host_accessible());
  std::vector<float> src(1 << 20), back(src.size(), -1.0f);
  std::iota(src.begin(), src.end(), 0.5f);
  const size_t bytes = src.size() * sizeof(float);
  void* d = dev->allocate(bytes);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(d) % dev->alignment(), 0u);
  dev->copy_from_host(d, src.data(), bytes);
  dev->copy_to_host(back.data(), d, bytes);
  EXPECT_EQ(src, back);
  dev->fill_zero(d, bytes);
  dev->copy_to_host(back.data(), d, bytes);
  EXPECT_EQ(std::count(back.begin(), back.end(), 0.0f), static_cast<long>(back.size()));
  dev->deallocate(d);
}

TEST(GpuDeviceMemory, HostArenaIsPinned) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  HostArena arena;
  void* p = arena.allocate(16 << 20);
  EXPECT_TRUE(arena.stats().pinned);
  arena.deallocate(p);
}

TEST(GpuDeviceMemory, DefaultChoiceIsTheGpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(make_device_memory()->kind(), DeviceKind::kCuda);
}

}  // namespace
}  // namespace strata::offload
