#pragma once
// ZeRO's sharding over chunk families: what every rank must agree on before
// the first collective, and the gather of a sharded chunk's shards. The
// gradient reductions are in reducer.h, the parameter gathers in gathers.h.

#include "../runtime/context.h"

namespace strata::parallel {

// Note [ZeRO over chunks]
// Stage s >= 1 registers sharded chunk families (Note [Sharded chunk
// families] in chunk.h): each rank keeps elements [rank * S, (rank + 1) *
// S) of every family's optimizer state and master (stage 1), gradient
// (stage 2) and parameters (stage 3), S = chunk capacity / world size.
// - Gradients (GradientReducer): stages 0 and 1 all-reduce the full gradient
//   chunk; stages 2 and 3 reduce-scatter it into the rank's gradient shard
//   during backward (same order and overlap as Note [Data parallel
//   gradients]) and release the full chunk as soon as its collective
//   completes. With accumulation the full chunk collects the micro-steps and
//   is reduced once.
// - Step (StepPipeline): each rank updates only the elements of its shard,
//   parameter by parameter (a parameter may span shards: each rank updates
//   its part, and every rank counts its step). The norm and overflow check
//   over gradient shards sum the ranks' partial sums. Stages 1 and 2 then
//   all-gather each parameter chunk in place while the next family updates
//   (StepGathers); stage 3 writes the parameter shard.
// - Stage 3 operators (OperatorGathers): before an operator its parameter
//   chunks are gathered (all-gather of the shards into the full chunk, on a
//   communicator of its own so gathers never interleave with gradient
//   reductions) and pinned there; gathered chunks outside the window (this
//   operator's chunks and, once a step has recorded the operator sequence,
//   the next kPrefetchLookaheadOps operators', within the device budget) are
//   released. Gathers for the window are issued ahead, so they overlap the
//   operators before them. The ranks agree on every gather in rounds (Note
//   [Gathers agreed in rounds] in gathers.h), so ranks may run different
//   operators on parameters (data-dependent branches). Gathered chunks are
//   not evictable; after backward all are released (the step changes the
//   shards).

/// Every rank must pack the parameters into the same chunk families and plan
/// the same stage-3 gathers, or their collectives would pair the wrong
/// buffers: compares the layout and the options the gather schedule depends
/// on across ranks, and fails on every rank, naming both sides, when they differ.
void check_same_layout_on_every_rank(EngineContext& ctx);

/// Every rank's shard of sharded chunk `c` (this rank's at `shard`, on host)
/// into `whole`, which holds the family layout's capacity in c's dtype.
/// Collective: every rank calls it for the same chunk.
void gather_shards(EngineContext& ctx, ChunkId c, const void* shard, void* whole);

}  // namespace strata::parallel
