#pragma once
// A memory trace: what the engine did, operator by operator, during traced
// (warm-up) steps. Written as JSON so other tools can read it; the schema is
// versioned and documented in docs/trace.md. `strata trace report` reads it.
//
// The engine records a trace when EngineOptions::trace_path is set (or
// STRATA_TRACE=path for any program using the engine); this header is the
// data model and its JSON, free of LibTorch; what the tool prints from it
// (report, per-layer activations, Chrome export, SVG) is tools/trace_views.h.

#include <array>
#include <cstdint>
#include <string>
#include <vector>
#include <utility>

#include "strata/memory/types.h"

namespace strata::memory {

constexpr int kTraceVersion = 2;

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
  uint64_t demand_bytes = 0;  // of `bytes`, moved by the thread that needed them (MoveStats::demand_bytes)
};

struct TraceOp {
  int64_t index = 0;  // position in the trace
  int step = 0;
  std::string name;   // "aten::addmm", or "strata::optimizer_step"
  std::string phase;  // forward, backward, recompute (activation checkpointing, in backward) or optimizer
  double start = 0.0;    // seconds since the trace began
  double seconds = 0.0;  // duration, including waits for chunks
  std::vector<TraceTouch> chunks;
  std::array<uint64_t, kNumTiers> model_bytes{};  // chunk bytes per tier after the operator
  uint64_t non_model_bytes = 0;  // activations and workspace live after the operator
  uint64_t non_model_peak = 0;   // their highest level during the operator
  std::vector<TraceMove> moves;  // chunk moves that finished during the operator
  std::vector<TraceMove> started;  // chunk moves that started during it (demand_bytes unused)
  std::vector<int64_t> params;   // the parameters it used (Trace::params indices); optional in the file
  double stall_seconds = 0.0;    // time spent waiting for chunks in flight
  uint64_t stall_bytes = 0;      // bytes of the chunks waited for in flight
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
  std::string policy;         // the engine's device policy: auto, lru or static
  bool prefetch = true;       // whether the engine read ahead
  double nvme_optim_fraction = -1.0;  // EngineOptions::nvme_optim_fraction (-1: auto)
  std::array<uint64_t, kNumTiers> budgets{};
  std::vector<TraceChunk> chunks;
  std::vector<std::string> params;  // the managed parameters' names, by id; optional in the file
  std::vector<TraceStep> steps;
  std::vector<TraceOp> ops;
};

std::string trace_to_json(const Trace& trace);
/// Throws strata::Error naming what is wrong: not JSON, not a strata trace,
/// another version, a missing field.
Trace trace_from_json(const std::string& text);

/// Writes to `path` through a temporary file and a rename: a reader never
/// sees half a trace. I/O errors are strata::Error naming the path.
void write_trace(const Trace& trace, const std::string& path);
/// The same atomic write for any text (the SVG and Chrome exports).
void write_text_file(const std::string& text, const std::string& path);
Trace read_trace(const std::string& path);

}  // namespace strata::memory

namespace strata::memory {

/// Note [Replaying a trace]
/// simulate_trace() replays the traced steps under other budgets and
/// policies and predicts bytes moved, stalls and step time.
///
/// Device tier, operator by operator: each operator's parameter chunks must be
/// on the device together (those already placed for it are pinned); a chunk
/// that is not there comes from host; room is made by evicting one chunk at a
/// time, by the policy object the engine itself uses (make_policy(): lru,
/// least recently used; auto, TracePolicy with the traced operators as its
/// plan, Belady; static, streamed chunks before held ones, Note [Static
/// placement]), among the chunks neither pinned for the operator nor still
/// arriving, as ChunkManager::make_room offers them; static returns the previous operator's streamed chunks to host
/// first; the optimizer step takes every parameter chunk to host, as the
/// engine's step does. With prefetch under auto, after an operator's chunks
/// are in, the next 4 operators' missing chunks are loaded when they all fit
/// in the free bytes and no earlier prefetch is still in flight, as the engine
/// does; a prefetched chunk stalls its operator only for the part of its copy
/// that compute did not cover.
///
/// Host and NVMe, per step in the steady state: the optimizer state of the
/// families homed on NVMe (nvme_optim_fraction as traced; under auto the
/// families whose state does not fit in half the host budget) is read and
/// written once a step. Host must hold every parameter and gradient chunk, the
/// state homed on host, and the NVMe families in flight (two with prefetch,
/// one without); what exceeds the host budget spills to NVMe and back each
/// step. Without prefetch the reads are stalls; with it the reads overlap
/// backward (as far as free host bytes allow) and the update of the previous
/// family. Write-backs overlap the update either way.
///
/// Time: an operator's compute is its traced time less its traced stalls and
/// the time of its on-demand moves at the given bandwidths; the step is the
/// compute plus the predicted stalls. Moves are serial per direction; the
/// model ignores contention between copies and compute (on a 2-core machine
/// they compete, so real steps there are slower than predicted).
struct SimulateOptions {
  uint64_t device_budget = 0;
  uint64_t host_budget = 0;     // 0: the trace's
  std::string policy = "lru";   // lru, auto or static
  double static_param_fraction = -1.0;  // static: as EngineOptions::static_param_fraction
  bool prefetch = true;
  double h2d_bytes_per_s = 10e9;
  double d2h_bytes_per_s = 10e9;
  double nvme_read_bytes_per_s = 2e9;
  double nvme_write_bytes_per_s = 1e9;
  bool record_evictions = false;  // fill SimulateResult::evicted
};

struct SimulateResult {
  uint64_t device_budget = 0, host_budget = 0;
  bool fits = true;            // every operator's chunks fit the budget together
  std::string why;             // when not: the operator and the bytes it needs
  // Over all traced steps:
  uint64_t h2d_bytes = 0, d2h_bytes = 0;
  uint64_t h2d_count = 0, d2h_count = 0;
  uint64_t evictions = 0;
  uint64_t prefetched_bytes = 0;  // of h2d_bytes, loaded ahead of use
  /// With SimulateOptions::record_evictions: each eviction, in order, as the
  /// trace index of the operator that made room and the chunk it evicted.
  std::vector<std::pair<int64_t, int64_t>> evicted;
  // Per step, steady state:
  size_t nvme_optim_families = 0;
  uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
  uint64_t host_spill_bytes = 0;  // host demand beyond the host budget
  double compute_seconds = 0.0;
  double device_stall_seconds = 0.0;
  double nvme_stall_seconds = 0.0;
  double step_seconds = 0.0;   // compute plus stalls
};

SimulateResult simulate_trace(const Trace& trace, const SimulateOptions& options);
/// The device bytes every operator needs at once (the smallest budget that
/// fits) and all parameter chunks together (everything resident).
std::pair<uint64_t, uint64_t> trace_device_bounds(const Trace& trace);

}  // namespace strata::memory
