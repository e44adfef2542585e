#pragma once
// An engine checkpoint read and rewritten without a training process (and
// without LibTorch): `strata checkpoint` and Engine::export_hf use it.
//   export_hf       one process's weights in Hugging Face's layout
//   convert_single  the whole training state merged into one part

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "strata/checkpoint/checkpoint_dir.h"
#include "strata/checkpoint/engine_state.h"
#include "strata/core/dtype.h"

namespace strata::checkpoint {

/// An engine checkpoint opened: its manifest, its layout and parameters, and
/// state.json as written.
struct EngineCheckpoint {
  CheckpointReader reader;
  StateIndex index;
  nlohmann::json state;
};
/// Throws an Error naming `dir` unless it is an engine checkpoint whose
/// state.json parses (its files are verified as they are read).
EngineCheckpoint open_engine_checkpoint(const std::string& dir);

int64_t element_count(const std::vector<int64_t>& shape);

/// What an export or a conversion wrote.
struct ConvertStats {
  uint64_t bytes = 0;  // of tensors written
  size_t files = 0, tensors = 0;
  double seconds = 0;
  std::string layout;  // the checkpoint's, described
};

/// Note [Exporting a checkpoint in Hugging Face's layout]: `out` gets
/// model-0000k-of-0000N.safetensors shards of at most `shard_bytes` (a
/// larger tensor alone in its shard) and model.safetensors.index.json, the
/// parameters in `dtype` (buffers and frozen parameters as they were saved).
ConvertStats export_hf(const std::string& dir, const std::string& out, uint64_t shard_bytes, DType dtype);
/// Note [Converting a checkpoint]: the training state as one part (tp 1 x pp 1) at `out`.
ConvertStats convert_single(const std::string& dir, const std::string& out);
/// The same, into the layout of `like`, a checkpoint of the same model saved
/// under the layout wanted (its part maps are the model's cuts there).
ConvertStats convert_like(const std::string& dir, const std::string& like, const std::string& out);

}  // namespace strata::checkpoint
