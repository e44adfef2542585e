#include "strata/offload/device_memory.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "strata/core/error.h"

namespace strata::offload {
namespace {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_.empty()) {
      unsetenv(name_);
    } else {
      setenv(name_, old_.c_str(), 1);
    }
  }

 private:
  const char* name_;
  std::string old_;
};

TEST(EmulatedDevice, RoundTripsThroughCopies) {
  auto dev = make_emulated_device_memory();
  EXPECT_EQ(dev->kind(), DeviceKind::kEmulated);
  EXPECT_TRUE(dev->host_accessible());
  std::vector<uint32_t> src(100000), back(src.size(), 0);
  std::iota(src.begin(), src.end(), 17u);
  const size_t bytes = src.size() * sizeof(uint32_t);
  void* d = dev->allocate(bytes);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(d) % dev->alignment(), 0u);
  dev->copy_from_host(d, src.data(), bytes);
  dev->copy_to_host(back.data(), d, bytes);
  EXPECT_EQ(src, back);
  dev->fill_zero(d, bytes);
  dev->copy_to_host(back.data(), d, bytes);
  EXPECT_EQ(std::count(back.begin(), back.end(), 0u), static_cast<long>(back.size()));
  dev->deallocate(d);
}

TEST(MakeDeviceMemory, HonoursStrataDevice) {
  {
    ScopedEnv env("STRATA_DEVICE", "emulated");
    EXPECT_EQ(make_device_memory()->kind(), DeviceKind::kEmulated);
  }
  {
    ScopedEnv env("STRATA_DEVICE", "tpu");
    try {
      make_device_memory();
      FAIL() << "accepted STRATA_DEVICE=tpu";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("emulated"), std::string::npos) << e.message();
    }
  }
  {
    ScopedEnv env("STRATA_DEVICE", "cuda:64");
    try {
      make_device_memory();
      FAIL() << "accepted a CUDA device that does not exist";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("STRATA_DEVICE=emulated"), std::string::npos) << e.message();
    }
  }
}

}  // namespace
}  // namespace strata::offload
