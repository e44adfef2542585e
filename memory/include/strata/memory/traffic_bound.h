#pragma once
// The least NVMe traffic an optimizer step can need, whatever its schedule
// (Note [The least traffic of a step]): what `strata bench scale` prints
// beside each step, and what the engine's own moves are checked against.

#include <cstdint>
#include <optional>

namespace strata::memory {

// Note [The least traffic of a step]
// One rank's optimizer step, in bytes:
//   E  the state that lives from one step to the next: the fp32 parameters
//      (the masters in mixed precision; the compute copy is derived from
//      them) and the optimizer's state, of the elements this rank updates;
//   G  the gradients of those elements, in the precision they are kept in;
//   M  the memory the state may stay in: the device and host tier budgets.
// What NVMe holds at a moment is what the memory does not: at least the
// state, less M. Every step reads all of E (forward needs the parameters,
// the update the optimizer state) and changes all of it.
//
// With a global fact between backward and the updates (exact global-norm
// clipping, or the overflow check that skips a step everywhere), no family
// is updated before every gradient exists: at that moment t* the memory
// holds g of the gradients and e of E, g + e <= M, and N = (G - g) + (E - e)
// bytes are on NVMe only. Each of them is read after t* (its update needs
// it), and each was written there: a gradient in this step's backward; a
// state byte after its update in the step before (else it could not be on
// NVMe only). So
//   - over many steps, a step moves on average at least 2 N >= 2 (E + G - M)
//     bytes: N read and N written (the steady bound); no schedule, however
//     it orders or overlaps its reads and writes, goes below it;
//   - one step alone moves at least N reads + (G - g) gradient writes +
//     (E - M) writes of the state it updated and cannot keep (it ends with
//     at most M of the new E in memory), least for g = min(G, M) and
//     e = min(E, M - g) (the step bound). It is below the steady bound by
//     the state writes an earlier step may have done for it.
// Without a global fact (no clipping, no overflow check: each family updated
// as soon as its gradients are final, the gradient never stored whole), the
// least is (E - M) read and (E - M) written, per step and steady alike.
// Padding, the compute copies of mixed precision and the parameters read
// again for recomputation and backward come on top: the bounds count none.
// A step skipped for overflow updates nothing, and the bounds do not hold
// for it; with gradient accumulation they are per optimizer step.
// Note [What an update in backward cannot keep]
// The bound without a global fact assumes all of M holds state from one
// step to the next. The engine's updates in backward (EngineOptions::
// update_in_backward) keep it on the host tier only, in chunks, and the
// host also holds, at some moment of every step, what the step works on:
//   S  the chunks that live between steps, in pages (Chunk::alloc_bytes): the
//      parameter chunks (in mixed precision the compute copies, which E
//      does not count, beside the fp32 masters) and the optimizer state;
//   H  the host tier's budget (the device tier holds compute copies and
//      gradients on their way, not state across steps);
//   F  the most one family's update holds at once: its parameter, master,
//      optimizer state and gradient chunks.
// Backward holds at most three families' worth beside the state: the
// family being updated, the next one's state read ahead, and the gradients
// of the one waiting for its update and of the one backward is filling
// (two gradients are less than one family). So at least H - 3F of S stays
// on host across steps. The rest is read once and written once: the
// updated optimizer state and masters leave before any parameter (Note
// [Updated optimizer state leaves before parameters]), so when the
// parameter chunks P (compute copies in mixed precision) fit in H - 3F
// they are read by no step, and a steady step of updates in backward moves
// at most S - (H - 3F) each way. Its excess over the bound, E - M, is then
// C + padding + D + 3F: the compute copies, the chunks' padding, the
// device budget and the working set. When P does not fit, forward and
// backward may each read parameters, and there is no such ceiling.
struct StepState {
  uint64_t persistent = 0;  // E
  uint64_t gradients = 0;   // G
  uint64_t memory = 0;      // M
  bool global_barrier = true;  // exact clipping or the overflow check
  // Note [What an update in backward cannot keep]; 0 where not known.
  uint64_t stored = 0;          // S
  uint64_t parameters = 0;      // P
  uint64_t host = 0;            // H
  uint64_t largest_update = 0;  // F
};

struct Traffic {
  uint64_t read = 0, written = 0;
  uint64_t total() const { return read + written; }
  /// Seconds at the store's bandwidths, in GB/s (1e9 bytes per second).
  double seconds(double read_gbps, double write_gbps) const;
};

struct TrafficBound {
  Traffic steady;    // per step, on average over many steps
  Traffic one_step;  // for any single step
};

/// The bounds of Note [The least traffic of a step].
TrafficBound least_step_traffic(const StepState& state);

/// The most a steady step of updates in backward moves each way (Note [What
/// an update in backward cannot keep]): S - (H - 3F); none when the
/// parameter chunks do not fit in H - 3F, or S is not known.
std::optional<Traffic> most_traffic_updating_in_backward(const StepState& state);

}  // namespace strata::memory
