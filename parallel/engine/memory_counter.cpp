#include "strata/parallel/memory_counter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace strata::parallel {
namespace {

std::atomic<uint64_t> g_current{0};
std::atomic<uint64_t> g_peak{0};
std::atomic<uint64_t> g_interval_peak{0};

void raise_peak(std::atomic<uint64_t>& peak, uint64_t now) {
  uint64_t p = peak.load(std::memory_order_relaxed);
  while (now > p && !peak.compare_exchange_weak(p, now, std::memory_order_relaxed)) {
  }
}

// LibTorch's raw_allocate() requires a DataPtr whose context is its data
// pointer, so the bookkeeping lives in a table keyed by that pointer instead.
struct Entry {
  size_t bytes;
  c10::DeleterFnPtr deleter;
};
std::mutex g_mu;
std::unordered_map<void*, Entry>& table() {
  static auto* t = new std::unordered_map<void*, Entry>();  // never destroyed, like the allocator
  return *t;
}

void release_counted(void* ptr) {
  Entry e{};
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = table().find(ptr);
    if (it == table().end()) return;  // cannot happen: every pointer handed out was entered
    e = it->second;
    table().erase(it);
  }
  g_current.fetch_sub(e.bytes, std::memory_order_relaxed);
  e.deleter(ptr);
}

// Both allocate() signatures are declared: LibTorch 1.13's base class has
// `allocate(size_t) const`, 2.x's `allocate(size_t)`; whichever matches
// overrides it. copy_data is pure virtual in 2.x and unused in 1.13.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) const { return counted(n); }
  c10::DataPtr allocate(size_t n) { return counted(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const { std::memcpy(dest, src, count); }
  c10::DeleterFnPtr raw_deleter() const override { return &release_counted; }

 private:
  c10::DataPtr counted(size_t n) const {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (data == nullptr || inner.get_context() != data) return inner;  // not a plain allocation: not counted
    const c10::DeleterFnPtr deleter = inner.get_deleter();
    const c10::Device device = inner.device();
    inner.release_context();
    {
      std::lock_guard<std::mutex> lock(g_mu);
      table()[data] = {n, deleter};
    }
    const uint64_t now = g_current.fetch_add(n, std::memory_order_relaxed) + n;
    raise_peak(g_peak, now);
    raise_peak(g_interval_peak, now);
    return c10::DataPtr(data, data, &release_counted, device);
  }
  c10::Allocator* inner_;
};

class CpuCounter final : public NonModelCounter {
 public:
  const char* source() const override { return "LibTorch CPU allocator (counting wrapper)"; }
  uint64_t current() override { return g_current.load(std::memory_order_relaxed); }
  uint64_t peak() override { return g_peak.load(std::memory_order_relaxed); }
  void reset_peak() override { g_peak.store(current(), std::memory_order_relaxed); }
  uint64_t interval_peak() override { return g_interval_peak.load(std::memory_order_relaxed); }
  void reset_interval_peak() override { g_interval_peak.store(current(), std::memory_order_relaxed); }
};

}  // namespace

NonModelCounter& cpu_non_model_counter() {
  static CpuCounter counter;
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: tensors allocated through it may outlive static destructors.
    auto* alloc = new CountingAllocator(c10::GetAllocator(c10::DeviceType::CPU));
    c10::SetAllocator(c10::DeviceType::CPU, alloc, /*priority=*/100);
  });
  return counter;
}

#ifndef STRATA_TORCH_CUDA
NonModelCounter* cuda_non_model_counter(int) { return nullptr; }
#endif

}  // namespace strata::parallel
