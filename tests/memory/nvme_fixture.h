#pragma once
// A real NVMe swap store (io_uring, O_DIRECT, real files) in a per-test
// temporary directory, with a fault injector, for the chunk manager tests.

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "strata/memory/nvme_swap_store.h"

namespace strata::memory::testing {

struct TestNvme {
  std::filesystem::path dir;
  std::shared_ptr<offload::FaultInjector> faults = std::make_shared<offload::FaultInjector>();
  std::shared_ptr<NvmeSwapStore> store;

  explicit TestNvme(uint64_t capacity, const std::string& tag = "") {
    static int counter = 0;
    dir = std::filesystem::temp_directory_path() /
          ("strata-mem-test-" + std::to_string(::getpid()) + "-" + tag + std::to_string(counter++));
    offload::NvmeStoreOptions o;
    o.directory = dir.string();
    o.capacity = capacity;
    o.block_bytes = 64 << 10;
    o.queue_depth = 16;
    o.faults = faults;
    store = std::make_shared<NvmeSwapStore>(o);
  }
  ~TestNvme() {
    store.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  bool holds(int64_t key) { return store->store().contains(key); }
  uint64_t stored_chunks() { return store->store().stats().chunks; }
};

}  // namespace strata::memory::testing
