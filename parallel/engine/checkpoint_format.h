#pragma once
// The engine checkpoint's format, shared by Engine::save (checkpoint_save.cpp)
// and Engine::load (checkpoint_load.cpp); export_weights and the weight
// import are weights.cpp. Private to strata_parallel.
//
// Note [Saving a checkpoint]
// A checkpoint holds what training needs to continue bit for bit, in a form
// that does not depend on placement: per parameter (by name, in the module's
// naming) its fp32 master weights, its optimizer state under torch's names
// (exp_avg and exp_avg_sq for Adam and AdamW, exp_avg for Lion,
// momentum_buffer for SGD with momentum), the compute copy in mixed
// precision, the gradient when saved mid-accumulation, and its step count;
// the optimizer's kind, each parameter group's hyper-parameters, the
// learning-rate schedule and its position, the loss scaler, the accumulation
// position and the RNG states. load() restores the hyper-parameters and the
// schedule (as torch's load_state_dict does) and refuses a checkpoint of
// another optimizer.
// Chunk sizes, budgets and tiers are not in it, so any budgets and placement
// load it. The tensors go to safetensors files, written chunk family by chunk
// family: each family's chunks are brought to host and pinned (from the device
// or NVMe, as the optimizer step does), their parameters' slices appended to
// the files, and unpinned, so the host never holds more than one family's
// chunks for the save. The directory is committed atomically (Note [Atomic
// checkpoint directories] in checkpoint_dir.h).
//
// Note [Loading a checkpoint]
// load() first verifies every file against the manifest (size and XXH3-64),
// then checks the parameter names, shapes and dtypes against the engine's,
// all before it changes anything: a damaged or mismatched checkpoint leaves
// the engine as it was. Then it streams the tensors into the chunks, family
// by family. If reading fails after that point (the disk fails mid-load), the
// engine's state is a mix; it says so, and train_step refuses until a load
// succeeds.
//
// Note [Checkpoints across ranks]
// Data parallel, save() and export_weights() are collective: every rank calls
// them, and rank 0 writes the one checkpoint, in the same format as a single
// process's. Under ZeRO each family's sharded chunks are all-gathered, one
// family at a time, so rank 0 writes whole tensors and no rank holds more than
// a family's chunks beyond its shards. Every rank's RNG state is kept
// (rng_cpu.bin is rank 0's, rng_cpu.rank<R>.bin rank R's). load() is called by
// every rank, each reading what it owns (its shards' ranges of each tensor),
// so a checkpoint loads at any ZeRO stage and any number of ranks, and each
// rank gets its own RNG state back when the world size matches. Gradients
// mid-accumulation are rank-local, so a data-parallel save must be on an
// accumulation boundary. When rank 0 cannot write (a full disk, a bad path),
// it keeps taking part in the gathers and a final all-reduce tells every
// rank, so all of them fail at once instead of waiting for a timeout, and
// the previous checkpoint stays.
//
// Note [Checkpoints across layouts]
// One checkpoint directory serves every layout. Its writers are the data
// group's rank 0 of each tensor rank of each pipeline stage: part
// k = pipeline rank x tensor size + tensor rank, of tensor x pipeline parts.
// Each writes its files (master.part<k>.safetensors and so on; one part
// keeps the names above) into the lead's temporary directory (part 0's: the
// lead makes it, and its path travels along the pipeline and each tensor
// group), every parameter under its checkpoint name (the model's own,
// without the pipeline's "stage<s>.": EngineOptions::checkpoint_name) and
// only the parts its tensor group's lower ranks do not hold already. The
// parts' file lists and pieces travel back to the lead, which writes
// state.json (the layout, and per parameter its whole shape and each piece's
// part and part map: Note [Parts of a whole parameter]) and commits the
// directory once, atomically, when every part was written; then every rank
// learns whether it was (the failure flag reduced over the data group, the
// tensor group and the pipeline). load() under any layout: each rank finds
// its parameters by checkpoint name, checks the whole shapes and that the
// pieces cover every element it holds, verifies the files it reads, then
// reads for each chunk its elements' overlaps with the saved pieces, so
// nothing is assembled whole and each rank reads its own elements only. The
// RNG states are each rank's when the layout is the same, else its data
// rank's of the first part, else the first rank's. A part whose layer did not say where it lies (mark_split without a
// map) is saved as <name>@tensor<r>of<P>, which only the same layout loads.

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../runtime/context.h"
#include "strata/checkpoint/engine_state.h"

namespace strata::parallel {

/// The manifest kind of an engine checkpoint.
inline constexpr const char* kEngineCheckpointKind = "strata-engine";

using checkpoint::part_file;
using checkpoint::part_map_json;

/// The safetensors name of a chunk dtype.
std::string st_dtype(DType d);

/// The RNG states of the CPU generator and, on a GPU, the device's, by file
/// name stem ("rng_cpu": rng_cpu.bin for rank 0, rng_cpu.rank<R>.bin for rank R).
std::vector<std::pair<std::string, at::Generator>> generators(const torch::Device& device);
/// Data rank `rank`'s state in part `part` of `parts`: <stem>.bin for rank 0
/// of one part, <stem>[.part<k>][.rank<R>].bin otherwise.
std::string rng_file(const std::string& stem, int rank, int part = 0, int parts = 1);

/// state.json's "optimizer": the kind, state arrays, each group's
/// hyper-parameters and the schedule with its position.
nlohmann::json optimizer_state(const EngineContext& s, int64_t optimizer_steps);

/// state.json, read back. Checkpoints from before optimizer groups hold
/// AdamW state and no "optimizer" entry: they read as AdamW with the
/// engine's own groups, schedule, dampening and nesterov.
struct SavedState {
  std::unordered_map<std::string, checkpoint::SavedParam> params;  // by checkpoint name
  checkpoint::SavedLayout layout;  // Note [Checkpoints across layouts]
  std::vector<std::string> module_state_files;
  std::string precision;
  int grad_accumulation = 1, micro_steps = 0, clean_steps = 0;
  int64_t skipped = 0;
  double loss_scale = 1.0;
  std::optional<double> previous_grad_norm;  // absent before the first step, and in older checkpoints
  std::vector<int> gradient_arrivals;        // Note [Updates in backward]; empty: not saved
  std::vector<std::string> rng_files;
  std::string optimizer = "adamw";
  std::vector<std::string> states = {"exp_avg", "exp_avg_sq"};
  std::vector<GroupSettings> groups;
  std::optional<LrSchedule> schedule;
  double dampening = 0.0;
  bool nesterov = false;
  int64_t optimizer_steps = 0;

  bool mid_accumulation() const { return micro_steps % grad_accumulation != 0; }
};
/// Parses `text` (the file at `path`); a malformed file is a strata::Error naming it.
SavedState parse_saved_state(const std::string& text, const std::string& path, const EngineContext& s);

}  // namespace strata::parallel
