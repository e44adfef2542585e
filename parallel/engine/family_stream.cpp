#include "family_stream.h"

#include <algorithm>
#include <unordered_map>

#include "../zero/sharding.h"

namespace strata::parallel {

std::vector<size_t> params_in_chunk_order(const EngineContext& ctx) {
  std::unordered_map<memory::FamilyId, size_t> position;
  for (size_t i = 0; i < ctx.families.size(); ++i) position[ctx.families[i]] = i;
  std::vector<size_t> order(ctx.params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const ManagedParam& pa = ctx.params[a];
    const ManagedParam& pb = ctx.params[b];
    return position[pa.family] != position[pb.family] ? position[pa.family] < position[pb.family]
                                                      : pa.offset < pb.offset;
  });
  return order;
}

std::vector<float> family_values(EngineContext& ctx, memory::FamilyId f) {
  const memory::ChunkFamily& fam = ctx.mgr->family(f);
  const ChunkId c = fam.master ? *fam.master : ctx.step_param(f);
  const memory::Chunk& chunk = ctx.mgr->chunk(c);
  std::vector<float> full(static_cast<size_t>(fam.layout->capacity_elems));
  std::vector<float> part(chunk.shard() ? static_cast<size_t>(chunk.capacity_elems()) : 0);
  float* dst = chunk.shard() ? part.data() : full.data();
  if (chunk.location()) ctx.mgr->read(c, dst, static_cast<size_t>(chunk.capacity_elems()) * sizeof(float));
  if (chunk.shard()) gather_shards(ctx, c, part.data(), full.data());
  return full;
}

}  // namespace strata::parallel
