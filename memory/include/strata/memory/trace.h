#pragma once
// A memory trace: what the engine did, operator by operator, during traced
// (warm-up) steps. Written as JSON so other tools can read it; the schema is
// versioned and documented in docs/trace.md. `strata trace report` reads it.
//
// The engine records a trace when EngineOptions::trace_path is set (or
// STRATA_TRACE=path for any program using the engine); this header is the
// data model and its JSON, free of LibTorch.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/memory/types.h"

namespace strata::memory {

constexpr int kTraceVersion = 1;

struct TraceChunk {
  int64_t id = 0;
  int32_t family = 0;
  std::string role;   // chunk_role_name(): param, master, grad, optim
  std::string dtype;  // dtype_name()
  uint64_t bytes = 0;           // alloc_bytes(): what it occupies on a tier
  int64_t capacity_elems = 0;
  int64_t used_elems = 0;       // elements of its tensors; the rest is padding
};

struct TraceTouch {
  int64_t chunk = 0;
  std::string tier;  // where the chunk was when the operator began: device, host, nvme or none
};

struct TraceMove {
  std::string from, to;
  uint64_t bytes = 0;
  uint64_t count = 0;
};

struct TraceOp {
  int64_t index = 0;  // position in the trace
  int step = 0;
  std::string name;   // "aten::addmm", or "strata::optimizer_step"
  std::string phase;  // forward, backward or optimizer
  double start = 0.0;    // seconds since the trace began
  double seconds = 0.0;  // duration, including waits for chunks
  std::vector<TraceTouch> chunks;
  std::array<uint64_t, kNumTiers> model_bytes{};  // chunk bytes per tier after the operator
  uint64_t non_model_bytes = 0;  // activations and workspace live after the operator
  uint64_t non_model_peak = 0;   // their highest level during the operator
  std::vector<TraceMove> moves;  // chunk moves that finished during the operator
  double stall_seconds = 0.0;    // time spent waiting for chunks in flight
};

struct TraceStep {
  int index = 0;
  int64_t first_op = 0;
  int64_t end_op = 0;  // one past the last
  double seconds = 0.0;
};

struct Trace {
  int version = kTraceVersion;
  std::string device;         // the device tier's name
  std::string non_model_source;  // how non-model bytes were measured
  std::array<uint64_t, kNumTiers> budgets{};
  std::vector<TraceChunk> chunks;
  std::vector<TraceStep> steps;
  std::vector<TraceOp> ops;
};

std::string trace_to_json(const Trace& trace);
/// Throws strata::Error naming what is wrong: not JSON, not a strata trace,
/// another version, a missing field.
Trace trace_from_json(const std::string& text);

/// The text summary of `strata trace report`: peak bytes per tier (model and
/// non-model) against the budgets, bytes moved per tier pair, stall time and
/// its share of the step, the `top` operators by non-model memory, and chunk
/// utilisation (padding waste).
std::string format_trace_report(const Trace& trace, size_t top = 10);

/// Chrome trace event format (loads in Perfetto and chrome://tracing):
/// operators as slices per phase, steps, chunk moves as slices on a track of
/// their own, and counters of model bytes per tier and non-model bytes.
std::string export_chrome_trace(const Trace& trace);

/// A self-contained SVG: model bytes per tier and non-model bytes over the
/// operator index, one panel per tier, with the budget lines, step
/// boundaries and the operators during which chunks moved marked.
std::string plot_trace_svg(const Trace& trace);

/// Writes to `path` through a temporary file and a rename: a reader never
/// sees half a trace. I/O errors are strata::Error naming the path.
void write_trace(const Trace& trace, const std::string& path);
/// The same atomic write for any text (the SVG and Chrome exports).
void write_text_file(const std::string& text, const std::string& path);
Trace read_trace(const std::string& path);

}  // namespace strata::memory

namespace strata::memory {

/// Note [Replaying a trace]
/// simulate_trace() replays the traced operators against another device
/// budget and policy: each operator's parameter chunks must be on the device
/// together (those already placed for it are pinned), a chunk that is not
/// there comes from host, room is made by evicting one chunk at a time (LRU:
/// least recently used; auto: the chunk whose next use in the trace is
/// furthest, Belady), and the optimizer step takes every parameter chunk to
/// host, as the engine's step does. It predicts the host <-> device traffic
/// only: host <-> nvme traffic is the trace's own, and the engine's prefetch is
/// not modelled (it moves the same chunks earlier). Step time is the traced
/// compute time (step time less the traced device moves at the given
/// bandwidths) plus the predicted moves at those bandwidths.
struct SimulateOptions {
  uint64_t device_budget = 0;
  std::string policy = "lru";  // lru or auto
  double h2d_bytes_per_s = 10e9;
  double d2h_bytes_per_s = 10e9;
};

struct SimulateResult {
  uint64_t device_budget = 0;
  bool fits = true;            // every operator's chunks fit the budget together
  std::string why;             // when not: the operator and the bytes it needs
  uint64_t h2d_bytes = 0, d2h_bytes = 0;
  uint64_t h2d_count = 0, d2h_count = 0;
  uint64_t evictions = 0;
  double step_seconds = 0.0;   // predicted, mean over the traced steps
};

SimulateResult simulate_trace(const Trace& trace, const SimulateOptions& options);
/// The device bytes every operator needs at once (the smallest budget that
/// fits) and all parameter chunks together (everything resident).
std::pair<uint64_t, uint64_t> trace_device_bounds(const Trace& trace);

}  // namespace strata::memory
