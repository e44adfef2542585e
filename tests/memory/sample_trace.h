#pragma once
// A small trace with known figures, for the trace format's tests and the
// tool's views of it.

#include "strata/memory/trace.h"

namespace strata::memory::testing {

// One step of two operators over a 4 KiB fp32 parameter chunk and a bf16 gradient chunk.
inline Trace sample_trace() {
  Trace t;
  t.device = "emulated in host memory";
  t.non_model_source = "test";
  t.policy = "auto";
  t.budgets = {4096, 1 << 20, 0};
  t.chunks.push_back({0, 0, "param", "fp32", 4096, 1024, 1000});
  t.chunks.push_back({1, 0, "grad", "bf16", 4096, 2048, 2048});
  TraceOp a;
  a.index = 0;
  a.name = "aten::addmm";
  a.phase = "forward";
  a.seconds = 0.002;
  a.chunks = {{0, "host"}};
  a.model_bytes = {4096, 4096, 0};
  a.non_model_bytes = 100;
  a.non_model_peak = 300;
  a.moves = {{"host", "device", 4096, 1, 4096}};
  a.started = {{"host", "device", 4096, 1, 0}};
  a.stall_seconds = 0.001;
  a.stall_bytes = 4096;
  TraceOp b = a;
  b.index = 1;
  b.name = "aten::gelu";
  b.phase = "backward";
  b.chunks.clear();
  b.non_model_peak = 900;
  b.moves = {{"host", "device", 4096, 1, 0}, {"device", "host", 8192, 2, 4096}};
  t.ops = {a, b};
  t.steps.push_back({0, 0, 2, 0.01});
  return t;
}

}  // namespace strata::memory::testing
