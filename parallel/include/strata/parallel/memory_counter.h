#pragma once
// Non-model memory: the bytes of activations, autograd temporaries and
// workspace, as opposed to the model state strata keeps in chunks. The tracer
// records them per operator and the device-capacity rule budgets around them.
//
// On CPU (the emulated device): a counting allocator wrapped around LibTorch's
// CPU allocator. Every tensor LibTorch allocates on CPU passes through it;
// strata's chunks do not (they come from the host arena and the device tier),
// so what it counts is what is not model state. Installed once per process on
// first use and never removed (tensors allocated through it may outlive
// anything); counting costs a small table entry and two atomic updates per
// allocation.
//
// On CUDA: the caching allocator's statistics (allocated bytes, aggregate
// pool). strata's device chunks come from its own device memory, not from
// that allocator, so again what it counts is not model state. The allocator
// keeps one peak register; both of ours are folded from it (Note [Two peaks
// from one register] in memory_counter_cuda.cpp).

#include <cstdint>

namespace strata::parallel {

class NonModelCounter {
 public:
  virtual ~NonModelCounter() = default;
  /// How the bytes are measured, for traces.
  virtual const char* source() const = 0;
  /// Bytes allocated and not yet freed.
  virtual uint64_t current() = 0;
  /// Highest current() since the last reset_peak() (the tracer's, per operator).
  virtual uint64_t peak() = 0;
  virtual void reset_peak() = 0;
  /// A second, independent peak register for the engine's device-capacity
  /// rule (per interval between operators with parameters).
  virtual uint64_t interval_peak() = 0;
  virtual void reset_interval_peak() = 0;
};

/// The CPU counter, installed on first call.
NonModelCounter& cpu_non_model_counter();
/// The CUDA caching allocator's counter for `device`; null when this build's
/// LibTorch has no CUDA.
NonModelCounter* cuda_non_model_counter(int device);

}  // namespace strata::parallel
