#pragma once
// Non-model memory on CPU: a counting allocator wrapped around LibTorch's CPU
// allocator. Every tensor LibTorch allocates on CPU (activations, autograd
// temporaries, workspace) passes through it; strata's chunks do not (they
// come from the host arena and the device tier), so what it counts is the
// memory that is not model state. The tracer reads it per operator.
//
// Installed once per process, on first use, and never removed (tensors
// allocated through it may outlive anything). Counting costs one small
// allocation and two atomic updates per LibTorch allocation.

#include <cstdint>

namespace strata::parallel {

struct CpuMemoryCounter {
  /// Installs the counter (idempotent) and returns it.
  static CpuMemoryCounter& install();
  /// Bytes allocated through LibTorch's CPU allocator and not yet freed.
  uint64_t current() const;
  /// Highest current() since the last reset_peak().
  uint64_t peak() const;
  void reset_peak();
  /// A second, independent peak register for the engine's device-capacity
  /// rule (the tracer resets the first at every operator).
  uint64_t interval_peak() const;
  void reset_interval_peak();
};

}  // namespace strata::parallel
