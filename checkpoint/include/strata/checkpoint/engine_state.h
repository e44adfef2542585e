#pragma once
// What an engine checkpoint's state.json says of its layout and its
// parameters (Note [Checkpoints across layouts] in
// parallel/engine/checkpoint_format.h), free of LibTorch: the engine's load
// and the `strata checkpoint` tool read it alike.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "strata/checkpoint/part_map.h"

namespace strata::checkpoint {

/// The file of tensor file `stem` (master, exp_avg, ...) that part `part` of
/// `parts` writes: <stem>.safetensors for one part, <stem>.part<k>.safetensors
/// otherwise.
std::string part_file(const std::string& stem, int part, int parts);

/// A part map in state.json: the whole's shape and the runs as a flat array
/// [part, whole, length, ...]; parsed and checked back.
nlohmann::json part_map_json(const PartMap& m);
PartMap part_map_from_json(const nlohmann::json& j, const std::string& what);

/// The layout a checkpoint was saved under.
struct SavedLayout {
  int tensor = 1, pipeline = 1;  // its writers: tensor x pipeline parts
  int world = 1;                 // the data-parallel group's size
  int zero_stage = 0;
  int parts() const { return tensor * pipeline; }
  /// "tp 2 x pp 1, dp 4 at ZeRO 3".
  std::string describe() const;
};

/// A part of a parameter one writer saved, under the parameter's name, in
/// its part's files (part_file).
struct SavedPiece {
  int part = 0;
  PartMap map;
};

struct SavedParam {
  std::string name;
  std::vector<int64_t> shape;  // the whole parameter's
  int64_t steps = 0;
  bool has_grad = false;
  std::vector<SavedPiece> pieces;  // a whole one in part 0 when state.json lists none (one part)
};

struct StateIndex {
  SavedLayout layout;
  std::string precision;
  std::string optimizer = "adamw";
  std::vector<std::string> states = {"exp_avg", "exp_avg_sq"};  // the optimizer's state files
  int64_t optimizer_steps = 0;
  std::vector<SavedParam> params;  // in the order saved
  std::vector<std::string> rng_files, module_state_files;
};

/// Parses state.json's layout, parameters and file lists; a malformed entry
/// is an Error naming `path`. (The engine reads the rest itself.)
StateIndex parse_state_index(const nlohmann::json& state, const std::string& path);

}  // namespace strata::checkpoint
