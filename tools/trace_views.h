#pragma once
// What `strata trace` shows of a memory trace (strata/memory/trace.h holds
// the data model, its JSON and the simulator; this is presentation).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/memory/trace.h"

namespace strata::tools {

/// The text summary of `strata trace report`: peak bytes per tier (model and
/// non-model) against the budgets, bytes moved per tier pair, stall time and
/// its share of the step, the `top` operators by non-model memory, and chunk
/// utilisation (padding waste).
std::string format_trace_report(const memory::Trace& trace, size_t top = 10);

/// Note [Activations per layer]
/// A layer is a parameter name cut to its first `depth` components (at most
/// all but the last): depth 2 makes "blocks.3.qkv.weight" the layer
/// "blocks.3". Over the last traced step's forward, each operator belongs to
/// the layer of the first parameter it used, or to the layer before it when
/// it used none (a GELU between two Linear layers). A layer's kept bytes are
/// the growth of non-model bytes (live after each operator) over its run of
/// operators: what it leaves for backward, its saved activations, which is
/// what checkpointing it would free (its input was made before it, so it stays
/// counted where it was made). A layer met twice (a tied embedding) adds up.
struct LayerActivations {
  std::string layer;
  uint64_t kept_bytes = 0;
  double forward_seconds = 0.0;  // its operators' traced time less their stalls (hook work included)
  int64_t ops = 0;
};
/// In order of first use; empty when the trace names no parameters.
std::vector<LayerActivations> layer_activations(const memory::Trace& trace, int depth = 2);

/// What checkpointing the layers matching `patterns` would do, from the
/// trace (a pattern is a layer name, or a prefix ending in '*'): forward
/// keeps none of their activations, so the non-model peak drops by their kept
/// bytes, less the largest of them, which comes back while its layer is
/// recomputed in backward; each step runs their forwards again.
struct CheckpointPrediction {
  std::vector<std::string> layers;  // the layers matched
  uint64_t freed_bytes = 0;         // their kept bytes
  uint64_t peak_before = 0, peak_after = 0;  // non-model peak of the last traced step
  double recompute_seconds = 0.0;   // per step, at most: their forward time as traced
  double step_seconds = 0.0;        // the last traced step as traced
};
CheckpointPrediction predict_checkpointing(const memory::Trace& trace, const std::vector<std::string>& patterns,
                                           int depth = 2);

/// Chrome trace event format (loads in Perfetto and chrome://tracing):
/// operators as slices per phase, steps, chunk moves as slices on a track of
/// their own, and counters of model bytes per tier and non-model bytes.
std::string export_chrome_trace(const memory::Trace& trace);

/// A self-contained SVG: model bytes per tier and non-model bytes over the
/// operator index, one panel per tier, with the budget lines, step
/// boundaries and the operators during which chunks moved marked.
std::string plot_trace_svg(const memory::Trace& trace);

}  // namespace strata::tools
