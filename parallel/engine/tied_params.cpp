// TiedParameters: Note [Tied parameters across stages] in tied_params.h.
#include "tied_params.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>

#include <nlohmann/json.hpp>

#include "param_access.h"
#include "strata/checkpoint/engine_state.h"
#include "strata/parallel/tensor_collectives.h"

namespace strata::parallel {

namespace {

using json = nlohmann::json;

// What names a copy across stages: the checkpoint name and the part (under
// tensor parallelism each tensor rank's stages tie their own parts).
std::string key_of(const ManagedParam& p) { return p.whole_name + " " + checkpoint::part_map_json(p.part).dump(); }

}  // namespace

TiedParameters::TiedParameters(EngineContext& ctx) : ctx_(ctx) {
  Communicator* pipe = ctx.options.pipeline_group.get();
  if (pipe == nullptr || pipe->world_size() <= 1) return;
  json mine = json::array();
  for (const ManagedParam& p : ctx.params) mine.push_back({key_of(p), p.numel, ctx.groups[p.group].name, p.name});
  const std::vector<std::string> all = all_gather_strings(*pipe, mine.dump());
  struct Holder {
    int rank;
    json entry;
  };
  std::map<std::string, std::vector<Holder>> holders;
  for (int r = 0; r < pipe->world_size(); ++r) {
    for (json& e : json::parse(all[static_cast<size_t>(r)])) holders[e[0].get<std::string>()].push_back({r, std::move(e)});
  }
  // Every rank checks every tie alike, so a refusal is every rank's.
  for (const auto& [key, hs] : holders) {
    if (hs.size() < 2) continue;
    ctx.stages_tied = true;
    const json& first = hs.front().entry;
    for (const Holder& h : hs) {
      STRATA_CHECK(h.entry[1] == first[1], "parameter ", h.entry[3].get<std::string>(), " on pipeline rank ", h.rank,
                   " is a copy of ", first[3].get<std::string>(), " on pipeline rank ", hs.front().rank, " (tied across "
                   "stages), but holds ", h.entry[1].get<int64_t>(), " elements there and ", first[1].get<int64_t>(),
                   " here: build the model the same on every rank");
      STRATA_CHECK(h.entry[2] == first[2], "parameter ", h.entry[3].get<std::string>(), " on pipeline rank ", h.rank,
                   " is in optimizer group \"", h.entry[2].get<std::string>(), "\", and its tied copy ",
                   first[3].get<std::string>(), " on pipeline rank ", hs.front().rank, " in \"",
                   first[2].get<std::string>(), "\": copies of one parameter must update alike; make the groups' "
                   "selection take both names or neither");
    }
  }
  std::map<std::vector<int>, std::vector<std::pair<std::string, size_t>>> by_ranks;
  for (size_t i = 0; i < ctx.params.size(); ++i) {
    const std::string key = key_of(ctx.params[i]);
    const std::vector<Holder>& hs = holders.at(key);
    if (hs.size() < 2) continue;
    std::vector<int> ranks;
    for (const Holder& h : hs) ranks.push_back(h.rank);
    ctx.params[i].stage_copies = static_cast<int>(ranks.size());
    by_ranks[ranks].emplace_back(key, i);
  }
  for (auto& [ranks, params] : by_ranks) {  // rank sets in order: the same splits on every member
    std::sort(params.begin(), params.end());
    Tie t;
    for (const auto& [key, i] : params) t.params.push_back(i);
    t.group = pipe->split(ranks, fmt::format("strata.tied.{}", fmt::join(ranks, "-")));
    ties_.push_back(std::move(t));
  }
}

void TiedParameters::sum_gradients(ParamAccess& access) {
  torch::NoGradGuard no_grad;
  for (Tie& t : ties_) {
    // Which stages used each parameter: a copy none used keeps no gradient, as in one process.
    std::vector<double> used;
    for (size_t i : t.params) used.push_back(ctx_.params[i].has_grad ? 1.0 : 0.0);
    const std::vector<double> all = all_gather_values(*t.group, used);
    for (size_t k = 0; k < t.params.size(); ++k) {
      bool any = false;
      for (size_t r = 0; r < all.size() / used.size(); ++r) any = any || all[r * used.size() + k] != 0.0;
      if (!any) continue;
      const size_t i = t.params[k];
      const ManagedParam& p = ctx_.params[i];
      // The gradient as the chunks hold it (the access's factor is 1): a copy of its own, summed in place.
      torch::Tensor g = p.has_grad ? access.grad(i).contiguous() : torch::zeros(p.shape, torch::kFloat32);
      if (t.group->device_buffers()) g = g.to(ctx_.device);
      all_reduce(*t.group, g)->wait();
      access.set_grad(i, g.cpu());
    }
  }
}

}  // namespace strata::parallel
