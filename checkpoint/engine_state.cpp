// state.json's layout and parameters: engine_state.h.
#include "strata/checkpoint/engine_state.h"

#include <fmt/format.h>

#include <unordered_set>

#include "strata/core/error.h"

namespace strata::checkpoint {

using json = nlohmann::json;

std::string part_file(const std::string& stem, int part, int parts) {
  return parts == 1 ? stem + ".safetensors" : fmt::format("{}.part{}.safetensors", stem, part);
}

json part_map_json(const PartMap& m) {
  std::vector<int64_t> runs;
  for (const PartMap::Run& r : m.runs) runs.insert(runs.end(), {r.part, r.whole, r.length});
  return {{"whole_shape", m.whole_shape}, {"runs", runs}};
}

PartMap part_map_from_json(const json& j, const std::string& what) {
  PartMap m;
  m.whole_shape = j.at("whole_shape").get<std::vector<int64_t>>();
  const std::vector<int64_t> runs = j.at("runs").get<std::vector<int64_t>>();
  STRATA_CHECK(runs.size() % 3 == 0, what, ": a part map's runs come in threes");
  for (size_t i = 0; i < runs.size(); i += 3) m.runs.push_back({runs[i], runs[i + 1], runs[i + 2]});
  m.check(what);
  return m;
}

std::string SavedLayout::describe() const {
  return fmt::format("tp {} x pp {}, dp {} at ZeRO {}", tensor, pipeline, world, zero_stage);
}

StateIndex parse_state_index(const json& st, const std::string& path) {
  StateIndex v;
  try {
    STRATA_CHECK(st.at("format") == "strata-engine-state", "not an engine state");
    v.precision = st.at("precision").get<std::string>();
    v.layout.world = st.value("world_size", 1);
    v.layout.zero_stage = st.value("zero_stage", 0);
    if (st.contains("layout")) {
      v.layout.tensor = st.at("layout").at("tensor").get<int>();
      v.layout.pipeline = st.at("layout").at("pipeline").get<int>();
      STRATA_CHECK(v.layout.tensor >= 1 && v.layout.pipeline >= 1, "a layout of fewer than one rank");
    }
    if (st.contains("optimizer")) {
      v.optimizer = st.at("optimizer").at("kind").get<std::string>();
      v.states = st.at("optimizer").at("states").get<std::vector<std::string>>();
      v.optimizer_steps = st.at("optimizer").at("optimizer_steps").get<int64_t>();
    }
    v.rng_files = st.at("rng").get<std::vector<std::string>>();
    if (st.contains("module_state")) v.module_state_files = st.at("module_state").get<std::vector<std::string>>();
    std::unordered_set<std::string> seen;
    for (const json& p : st.at("parameters")) {
      SavedParam param{p.at("name").get<std::string>(), p.at("shape").get<std::vector<int64_t>>(),
                       p.at("steps").get<int64_t>(), p.at("has_grad").get<bool>(), {}};
      STRATA_CHECK(seen.insert(param.name).second, "parameter ", param.name, " twice");
      if (p.contains("pieces")) {
        for (const json& piece : p.at("pieces")) {
          const int part = piece.at("part").get<int>();
          STRATA_CHECK(part >= 0 && part < v.layout.parts(), "parameter ", param.name, " has a piece of part ", part,
                       " of ", v.layout.parts());
          param.pieces.push_back({part, part_map_from_json(piece.at("map"), "parameter " + param.name)});
          STRATA_CHECK(param.pieces.back().map.whole_shape == param.shape, "parameter ", param.name,
                       ": a piece of another shape than the parameter's");
        }
      } else {
        STRATA_CHECK(v.layout.parts() == 1, "parameter ", param.name, " lists no pieces in a checkpoint of ",
                     v.layout.parts(), " parts");
        param.pieces.push_back({0, PartMap::whole(param.shape)});
      }
      v.params.push_back(std::move(param));
    }
  } catch (const std::exception& e) {
    STRATA_FAIL(path, ": malformed engine state: ", e.what());
  }
  return v;
}

}  // namespace strata::checkpoint
