#pragma once
// Pipeline schedules as data: the ordered actions each rank of a pipeline
// runs in one step, and a dataflow simulation of them. No LibTorch here: the
// runtime (pipeline.h), the tests and `strata bench pipeline` share it.
//
// Ranks r = 0..p-1 hold v virtual stages each (v > 1 only for interleaved
// 1F1B): virtual stage s = c * p + r for the rank's model chunk c, so the
// stages run 0, 1, .., p*v-1 across the ranks, wrapping from rank p-1 to
// rank 0 between chunks. m microbatches pass through every stage.
//
// Note [Pipeline actions]
// F(s, k) runs stage s forward on microbatch k; B(s, k) its backward (input
// and weight gradients); under zero-bubble, BI(s, k) the input gradients
// only and W(s, k) the weight gradients, later. A rank's actions on one
// stage keep microbatch order within each kind, and every link between two
// neighbouring stages carries activations (and, back, gradients) in the
// order both its ends run them; simulate() checks that a set of orders
// completes, which is how the runtime refuses a schedule that would hang.

#include <cstdint>
#include <string>
#include <vector>

namespace strata::parallel::pipeline {

enum class Schedule {
  kGPipe,            // "gpipe": every forward, then every backward
  k1F1B,             // "1f1b": p - r - 1 warm-up forwards, then one forward, one backward
  kInterleaved1F1B,  // "interleaved-1f1b": Megatron's, v model chunks per rank
  kZeroBubbleH1,     // "zb-h1": 1F1B with the backward split, weight passes in the bubbles
};
/// PyTorch's names: "gpipe", "1f1b", "interleaved-1f1b", "zb-h1"; anything
/// else is an error listing them.
Schedule schedule_from_name(const std::string& name);
const char* schedule_name(Schedule s);

enum class ActionKind { kForward, kBackward, kBackwardInput, kBackwardWeight };
struct Action {
  ActionKind kind;
  int stage;       // virtual stage, 0 .. p*v-1
  int microbatch;  // 0 .. m-1
  bool operator==(const Action& o) const {
    return kind == o.kind && stage == o.stage && microbatch == o.microbatch;
  }
};
/// "F3.1" style: kind, stage, microbatch.
std::string to_string(const Action& a);

/// Checks p >= 1, m >= 1, v >= 1 (v > 1 only for interleaved, which needs m
/// divisible by p, as Megatron's); an Error says what to change.
void check_schedule(Schedule s, int p, int v, int m);
/// The actions rank `rank` of `p` runs in one step, in order.
std::vector<Action> schedule_actions(Schedule s, int rank, int p, int v, int m);

/// Costs of one action per stage, in any unit.
struct ActionCosts {
  double forward = 1.0;
  double backward_input = 1.0;   // B's input-gradient part (a full B costs both)
  double backward_weight = 1.0;  // B's weight-gradient part
};
struct SimulatedStep {
  bool completes = false;   // false: the orders wait on each other (would hang)
  std::string stuck;        // when not: each rank's next action, waiting
  double time = 0.0;        // when the last rank finishes
  std::vector<double> busy; // per rank
  /// max over ranks of idle / time: the bubble fraction.
  double bubble() const;
  /// Per rank, the most microbatches whose activations are held at once
  /// (forward done, backward weight pass not yet).
  std::vector<int> peak_in_flight;
};
/// Runs every rank's actions as dataflow with the given costs, sends
/// free and immediate (Note [Pipeline actions]).
SimulatedStep simulate(const std::vector<std::vector<Action>>& per_rank, int p, int v, const ActionCosts& costs);

/// The bubble fraction the literature gives for the schedule with equal
/// stages: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved
/// (Megatron's bubble (p-1)/v over the v*m chunk passes), and
/// (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)) for ZB-H1 (the zero-bubble paper).
double bubble_formula(Schedule s, int p, int v, int m, const ActionCosts& costs);

/// Cuts `costs` (one per layer, non-negative) into `parts` contiguous,
/// non-empty pieces minimising the largest piece's sum; returns the parts+1
/// boundaries (0, .., costs.size()). An Error when there are fewer layers
/// than parts.
std::vector<int> partition_balanced(const std::vector<double>& costs, int parts);

/// What each layer of a model cost in a recorded trace (docs/trace.md): the
/// operators' seconds, forward and backward, and the activation bytes its
/// forward left alive (the rise in non-model bytes over its forward
/// operators). Layer i is the one whose parameters are named "i.<...>"
/// (a torch::nn::Sequential attached whole) or "<prefix>.i.<...>" (the
/// first numeric part of the name: a Pipeline's "stage<s>.i.<...>"). An
/// operator without parameters counts for the layer of the last one with
/// them. The trace's last step is read (the first may be a warm-up).
struct LayerCosts {
  std::vector<double> seconds;
  std::vector<double> activation_bytes;
};
LayerCosts trace_layer_costs(const std::string& trace_path, int layers);
/// One cost per layer for partition_balanced: each layer's share of the
/// time, and (weight `memory_weight`, 0..1) of the activation bytes.
std::vector<double> mixed_costs(const LayerCosts& costs, double memory_weight);

}  // namespace strata::parallel::pipeline
