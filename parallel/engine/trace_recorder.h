#pragma once
// TraceRecorder: the engine's memory tracer (Note [Recording a trace]). It
// turns the operators of the first EngineOptions::trace_steps steps into a
// memory::Trace and writes it; after that it records nothing.

#include <mutex>
#include <string>
#include <vector>

#include "../runtime/context.h"
#include "strata/memory/trace.h"
#include "strata/parallel/memory_counter.h"

namespace strata::parallel {

// Note [Recording a trace]
// While a traced step runs, the operator hook reports every operator (not
// only those touching parameters). Each becomes a TraceOp: the parameter
// chunks it touched and where they were when it began, chunk bytes per tier
// after it, non-model bytes (NonModelCounter) live after it and their peak
// during it, and the chunk moves started and finished (and how many bytes of
// those were moved on demand) and the stall time since the previous record,
// so that moves between operators (prefetches) are counted once. The
// optimizer step is one more record, "strata::optimizer_step". After
// trace_steps steps the trace is written (write_trace: temporary file and
// rename) and recording stops. Data parallel, rank R > 0 writes
// <stem>.rank<R><extension> beside the path given, rank 0 the path itself;
// pipeline stage S (EngineOptions::pipeline_group) adds .stage<S> before it.
class TraceRecorder {
 public:
  /// Describes the context's chunks and budgets; records from the next begin_step().
  TraceRecorder(const EngineContext& ctx, NonModelCounter& counter);

  /// Inside a traced step: operators are recorded.
  bool recording() const { return recording_; }
  /// Whether the wanted steps were recorded and the trace written.
  bool done() const { return done_; }
  const std::string& path() const { return path_; }
  const memory::Trace& trace() const { return trace_; }

  void begin_step();
  /// Ends a traced step; writes the trace after the last wanted one.
  void end_step();
  /// forward, backward or optimizer: the phase of the operators that follow.
  void set_phase(const char* phase) { phase_ = phase; }
  /// An operator begins; `ids` are the managed parameters among its arguments.
  void begin_op(const std::string& name, const std::vector<int64_t>& ids);
  void end_op();

 private:
  double since(Clock::time_point a) const { return seconds_since(a); }

  const EngineContext& ctx_;
  NonModelCounter& counter_;
  memory::Trace trace_;
  std::string path_;
  bool recording_ = false;
  bool done_ = false;
  std::string phase_;
  Clock::time_point t0_, op_t0_, step_t0_;
  memory::MoveStats last_;
  memory::TraceOp current_;
  int64_t step_first_op_ = 0;
  std::mutex mu_;
};

}  // namespace strata::parallel
