#pragma once
// HybridPlan: how one training job is laid out over its ranks, in one place:
// data parallelism and the ZeRO stage, the pipeline (schedule, microbatches,
// virtual stages, the cut), tensor parallelism (size, mode, Megatron's
// sequence parallelism, the module plan of parallelize()) and sequence
// parallelism (size, attention). Trainer (trainer.h) applies it to a user's
// module; docs/parallel.md.
//
// A plan is written in C++, read from a JSON file (the job's config file),
// or from environment variables, and validate() refuses what cannot run
// before any rank has made a communicator:
//
//   {
//     "dp": 2, "zero_stage": 2,
//     "pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 4},
//     "tensor": {"size": 2, "mode": "1d", "sequence_parallel": false,
//                "layers": [["blocks.*.qkv", "columnwise(fused=3)"], ["blocks.*.proj", "rowwise"]]},
//     "sequence": {"size": 1, "mode": "ring-attention"}
//   }
//
// Every key is optional (sizes default to 1; "dp": 0 or absent means the
// ranks the other axes leave). Unknown keys are errors, so a typo never
// silently trains another layout.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/parallel/parallelize.h"
#include "strata/parallel/pipeline_schedule.h"
#include "strata/parallel/sequence_parallel.h"

namespace strata::parallel {


/// A style as the config file writes it: "columnwise", "columnwise(fused=3,
/// gather)", "rowwise", "rowwise(sequence=1)", "vocab_embedding",
/// "vocab_embedding(untied)", "replicated", "sequence_shard(dim=0)";
/// "sequence=D" on columnwise, rowwise and vocab_embedding is
/// along_sequence(D). Errors name the text and list the choices.
ParallelStyle parse_style(const std::string& text);
std::string style_name(const ParallelStyle& style);

/// What the plan needs to know of the model to refuse sizes that do not
/// divide it; 0 where unknown (that check is skipped).
struct ModelShape {
  int64_t hidden = 0;   // the residual stream's width
  int64_t heads = 0;    // attention heads
  int64_t context = 0;  // positions per sequence
  int64_t layers = 0;   // entries of the Sequential the pipeline cuts
};

struct HybridPlan {
  int dp = 0;  // 0: the world's ranks divided by pp * tp * sp
  int zero_stage = 0;
  struct Pipeline {
    int size = 1;
    pipeline::Schedule schedule = pipeline::Schedule::k1F1B;
    int microbatches = 0;    // 0: twice the stages
    int virtual_stages = 1;  // interleaved-1f1b: model chunks per rank
    /// size * virtual_stages + 1 layer indices; empty: balanced by parameter
    /// count, or by `trace`'s measured costs when given.
    std::vector<int> boundaries;
    std::string trace;           // a `strata trace record` file of the model: the cut from its costs
    double memory_weight = 0.5;  // with `trace`: time vs memory (pipeline::mixed_costs)
  } pp;
  struct Tensor {
    int size = 1;
    TensorMode mode = TensorMode::k1D;
    int depth = 1;  // 2.5D: the grid's depth (size = q * q * depth)
    /// Megatron's sequence parallelism: the module plan's styles shard
    /// activations along the sequence (ParallelStyle::along_sequence).
    bool sequence_parallel = false;
    ParallelPlan layers;  // 1D: parallelize()'s plan
  } tp;
  struct Sequence {
    int size = 1;
    sequence::Mode mode = sequence::Mode::kRingAttention;
    int64_t dim = 1;  // the inputs' sequence dimension, sharded over the group
  } sp;

  /// Parses the config file's JSON text; `origin` names it in errors.
  static HybridPlan from_json(const std::string& text, const std::string& origin = "the plan");
  static HybridPlan from_file(const std::string& path);
  /// STRATA_PLAN (a config file) when set, then these variables over it:
  /// STRATA_DP, STRATA_ZERO_STAGE, STRATA_PP, STRATA_PP_SCHEDULE,
  /// STRATA_MICROBATCHES, STRATA_VIRTUAL_STAGES, STRATA_TP, STRATA_TP_MODE,
  /// STRATA_TP_DEPTH, STRATA_TP_SEQUENCE_PARALLEL (0/1), STRATA_SP, STRATA_SP_MODE.
  /// `base` supplies what neither sets (a module plan written in C++).
  static HybridPlan from_env(HybridPlan base);
  static HybridPlan from_env();
  std::string to_json() const;

  /// The plan for `world_size` ranks: dp resolved, microbatches defaulted,
  /// and every check below passed. Throws an Error saying what to change:
  /// sizes that do not multiply to the world, a tensor mode whose grid the
  /// size does not form, Megatron's sequence parallelism without 1D tensor
  /// parallelism or without a style that shards along the sequence, a
  /// schedule that cannot run the microbatches or virtual stages, a cut of
  /// the wrong length, and (where `shape` says) heads, hidden size, context
  /// or layers the sizes do not divide. Runs no collective.
  HybridPlan validated(int world_size, const ModelShape& shape = {}) const;
  /// Ranks the plan needs (dp must be set).
  int world_size() const { return dp * pp.size * tp.size * sp.size; }
  /// The mesh's dims: dp, pp, tp, sp.
  std::array<int, 4> dims() const { return {dp, pp.size, tp.size, sp.size}; }
  /// "dp 2 (ZeRO 2) x pp 2 (1f1b, 4 microbatches) x tp 2 (1d) x sp 1".
  std::string describe() const;
};

}  // namespace strata::parallel
