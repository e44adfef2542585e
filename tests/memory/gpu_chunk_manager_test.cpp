// The chunk manager over a real CUDA device and pinned host memory. Skips without a GPU.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "strata/memory/chunk_manager.h"
#include "strata/offload/cuda_runtime.h"
#include "strata/offload/device_memory.h"

namespace strata::memory {
namespace {

TEST(GpuChunkManager, EvictsBetweenGpuAndPinnedHostKeepingContents) {
  if (offload::cuda::probe().devices.empty()) GTEST_SKIP() << "no CUDA device";
  constexpr int64_t kElems = 1 << 20;  // 4 MiB fp32 chunks
  ChunkManagerOptions o;
  o.budgets = {3 * 4 * (1 << 20), 16 * 4 * (1 << 20), 0};
  o.device = offload::make_cuda_device_memory(0);
  ChunkManager mgr(std::move(o));
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 8; ++i) specs.push_back({"w" + std::to_string(i), kElems});
  const Registration reg = mgr.register_tensors(specs, FamilySpec{}, kElems);
  std::vector<std::vector<float>> want;
  for (size_t i = 0; i < reg.families.size(); ++i) {
    const ChunkId id = mgr.family(reg.families[i]).param;
    void* p = mgr.access(id, Tier::kDevice);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u);
    std::vector<float> v(kElems);
    std::iota(v.begin(), v.end(), static_cast<float>(i * 7));
    mgr.write(id, v.data(), v.size() * sizeof(float));
    want.push_back(std::move(v));
  }
  EXPECT_TRUE(mgr.host_arena().stats().pinned);
  EXPECT_LE(mgr.tier_stats(Tier::kDevice).peak, mgr.tier_stats(Tier::kDevice).budget);
  EXPECT_GE(mgr.tier_stats(Tier::kDevice).evictions, 5u);
  for (size_t i = 0; i < reg.families.size(); ++i) {
    const ChunkId id = mgr.family(reg.families[i]).param;
    mgr.access(id, Tier::kDevice);
    std::vector<float> got(kElems);
    mgr.read(id, got.data(), got.size() * sizeof(float));
    EXPECT_EQ(got, want[i]) << "chunk " << id;
  }
}

}  // namespace
}  // namespace strata::memory
