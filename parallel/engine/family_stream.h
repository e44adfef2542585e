#pragma once
// Checkpoint streaming: visiting the chunk families one at a time with their
// chunks pinned on host, so that save, load, weight export and detach never
// hold more than one family's chunks beyond what training holds (Note
// [Saving a checkpoint] in checkpoint_format.h).

#include <functional>
#include <vector>

#include "../runtime/context.h"

namespace strata::parallel {

/// Trainable parameters (indices into ctx.params) in the order their bytes lie in chunk families.
std::vector<size_t> params_in_chunk_order(const EngineContext& ctx);

/// Visits the chunk families in step order, each with `chunks(f)` pinned on
/// host; `each(param, family)` runs for its parameters in chunk order, after
/// `pinned(i)` for family i.
template <typename Chunks, typename Each>
void stream_families(EngineContext& ctx, Chunks chunks, Each each, const std::function<void(size_t)>& pinned = nullptr) {
  const std::vector<size_t> order = params_in_chunk_order(ctx);
  size_t next = 0;
  for (size_t i = 0; i < ctx.families.size(); ++i) {
    const memory::FamilyId f = ctx.families[i];
    const memory::ChunkFamily& fam = ctx.mgr->family(f);
    ctx.with_on_host(chunks(f), [&] {
      if (pinned) pinned(i);
      for (; next < order.size() && ctx.params[order[next]].family == f; ++next) each(ctx.params[order[next]], fam);
    });
  }
}

/// A family's fp32 values over its whole layout: the master weights in mixed
/// precision, else the parameters. Sharded (stage 1 or 2 in mixed precision,
/// stage 3) they are all-gathered, so every rank must call this for the same
/// families in the same order.
std::vector<float> family_values(EngineContext& ctx, memory::FamilyId f);

}  // namespace strata::parallel
