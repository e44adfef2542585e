#include "sharding.h"

#include <algorithm>

#include "strata/core/bytes.h"
#include "strata/core/error.h"

namespace strata::parallel {

void check_same_layout_on_every_rank(EngineContext& ctx) {
  const EngineOptions& options = ctx.options;
  std::vector<double> mine = {static_cast<double>(ctx.families.size()), static_cast<double>(ctx.stage),
                              static_cast<double>(options.budgets.device), options.prefetch ? 1.0 : 0.0,
                              options.device_capacity > 0 ? 1.0 : 0.0};
  double weighted = 0, total = 0;
  for (size_t i = 0; i < ctx.families.size(); ++i) {
    const double cap = static_cast<double>(ctx.mgr->family(ctx.families[i]).layout->capacity_elems);
    total += cap;
    weighted += cap * static_cast<double>(i + 1);
  }
  mine.push_back(total);
  mine.push_back(weighted);
  double numel = 0;
  for (const ManagedParam& p : ctx.params) numel += static_cast<double>(p.numel);
  mine.push_back(static_cast<double>(ctx.params.size()));
  mine.push_back(numel);
  const std::vector<double> all = all_gather_values(*ctx.comm, mine);
  for (int r = 0; r < ctx.world(); ++r) {
    const double* theirs = all.data() + static_cast<size_t>(r) * mine.size();
    STRATA_CHECK(std::equal(mine.begin(), mine.end(), theirs), "rank ", ctx.rank, " packs ", ctx.params.size(),
                 " parameters (", static_cast<int64_t>(numel), " elements) into ", ctx.families.size(),
                 " chunk families of ", static_cast<int64_t>(total), " elements (ZeRO stage ", ctx.stage,
                 ", device budget ", format_bytes(options.budgets.device), ") but rank ", r, " packs ",
                 static_cast<int64_t>(theirs[7]), " (", static_cast<int64_t>(theirs[8]), " elements) into ",
                 static_cast<int64_t>(theirs[0]), " of ", static_cast<int64_t>(theirs[5]), " (stage ",
                 static_cast<int>(theirs[1]), ", device budget ", format_bytes(static_cast<uint64_t>(theirs[2])),
                 "); every rank needs the same model, chunk_elems, zero_stage, device budget, prefetch and "
                 "device_capacity setting");
  }
}

void gather_shards(EngineContext& ctx, ChunkId c, const void* shard, void* whole) {
  const memory::Chunk& chunk = ctx.mgr->chunk(c);
  ctx.comm->all_gather(shard, whole, static_cast<size_t>(chunk.capacity_elems()), chunk.dtype())->wait();
}

}  // namespace strata::parallel
