#pragma once
// parallelize(): 1D (Megatron) tensor parallelism applied to an unmodified
// module. A plan maps submodule names to styles; parallelize() keeps this
// rank's part of each matched torch::nn::Linear or Embedding weight in place
// (the same parameter objects, smaller), and from then on the module's own
// forward communicates where the style says: the split parameters carry
// their layout and the operators that use them (linear, embedding) run in
// their tensor-parallel form (Note [Tensor-parallel operators on unmodified
// modules] in parallel/dispatch/placement.h), as PyTorch's parallelize_module
// does with DTensor. docs/tensor_parallel.md.
//
//   auto mesh = DeviceMesh::create(*world, {dp, 1, tp, 1});
//   parallelize(*model, mesh, {{"blocks.*.qkv", ParallelStyle::columnwise(3)},
//                              {"blocks.*.proj", ParallelStyle::rowwise()},
//                              {"blocks.*.up", ParallelStyle::columnwise()},
//                              {"blocks.*.down", ParallelStyle::rowwise()},
//                              {"tok", ParallelStyle::vocab_embedding()}});
//   auto engine = attach(*model, adamw, options, data_parallel_group);
//
// What the module's code must allow: a column-wise layer's output holds this
// rank's slice of its features, so code that reshapes it must infer the
// local size (view({b, t, -1, head_dim}), not view({b, t, heads, head_dim})),
// as with DTensor's local outputs. Call parallelize() on every rank of the
// group, with the same plan, before attach.

#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "strata/parallel/device_mesh.h"

namespace strata::parallel {

struct ParallelStyle {
  enum class Kind {
    kColumnwise,      // Linear: output features split (its output holds this rank's slice); Embedding: its dim split
    kRowwise,         // Linear: input features split, output all-reduced; the bias stays whole
    kVocabEmbedding,  // Embedding: vocabulary rows split, lookups all-reduced
    kReplicated,      // every rank holds all of it (the default for what the plan does not name)
    kSequenceShard,   // whole on every rank, used on sequence shards: LayerNorm, or an Embedding of positions
  };
  Kind kind = Kind::kReplicated;
  /// Columnwise: the weight stacks `fused` equal blocks along its output
  /// features (a fused QKV projection: 3), each split over the group, so each
  /// rank's output holds its slice of every block in block order (so its
  /// output cannot be gathered).
  int fused = 1;
  /// Columnwise: all-gather the output's last dimension (the whole output on
  /// every rank). Vocab embedding: the same for a linear that uses its weight
  /// as the output projection (tied embeddings), so the logits are whole.
  bool gather_output = false;
  /// Megatron's sequence parallelism (Note [Megatron's sequence parallelism]
  /// in tensor_parallel.h): activations between a row-wise layer and the next
  /// column-wise one hold 1/P of dimension `sequence_dim` on each rank.
  /// Columnwise: the input is such a shard, all-gathered along it. Rowwise:
  /// the output is reduce-scattered along it. Vocab embedding: lookups are
  /// reduce-scattered along it, and a tied output projection gathers its input.
  bool sequence_parallel = false;
  int64_t sequence_dim = 1;

  static ParallelStyle columnwise(int fused = 1, bool gather_output = false) {
    return {Kind::kColumnwise, fused, gather_output};
  }
  static ParallelStyle rowwise() { return {Kind::kRowwise, 1, false}; }
  static ParallelStyle vocab_embedding(bool gather_tied_logits = true) {
    return {Kind::kVocabEmbedding, 1, gather_tied_logits};
  }
  static ParallelStyle replicated() { return {Kind::kReplicated, 1, false}; }
  /// A LayerNorm on sequence shards (its gradients summed over the group), or
  /// an Embedding of positions whose lookups each rank keeps 1/P of along `dim`
  /// of the output (the position rows of its shard).
  static ParallelStyle sequence_shard(int64_t dim = 0) {
    ParallelStyle s{Kind::kSequenceShard, 1, false};
    s.sequence_parallel = true;
    s.sequence_dim = dim;
    return s;
  }
  /// This style with its activations sharded along `dim` (columnwise, rowwise, vocab_embedding).
  ParallelStyle along_sequence(int64_t dim = 1) const {
    ParallelStyle s = *this;
    s.sequence_parallel = true;
    s.sequence_dim = dim;
    return s;
  }
};

/// (submodule name pattern, style), in order. A pattern matches a name of
/// named_modules() atom by atom ("blocks.*.qkv"; fnmatch wildcards within an
/// atom, "*" for any one atom). Every pattern must match a submodule, and no
/// submodule two patterns.
using ParallelPlan = std::vector<std::pair<std::string, ParallelStyle>>;

/// Tensor parallelism's modes: Megatron's 1D split, SUMMA's 2D grid,
/// Tesseract's 2.5D (a q x q grid at each of `depth` levels) and the 3D cube
/// (tensor_parallel_2d.h, tensor_parallel_3d.h).
enum class TensorMode { k1D, k2D, k2_5D, k3D };
/// By its config-file name: "1d", "2d", "2.5d", "3d"; an unknown name is an
/// error listing them.
TensorMode parse_tensor_mode(const std::string& name);
const char* tensor_mode_name(TensorMode mode);
/// The grid's side for `size` ranks in `mode`: q of a q x q (2d) or q x q x
/// `depth` (2.5d) grid, d of a d x d x d cube (3d), `size` in 1d; 0 when
/// the size does not form that grid (or `depth` does not belong to the mode).
int tensor_grid_side(TensorMode mode, int size, int depth = 1);

struct ParallelizeResult {
  std::vector<std::string> split;  // the submodules split, by name
  int64_t local_params = 0;        // this rank's parameter elements after
  int64_t full_params = 0;         // the module's before
};

/// Splits `module`'s parameters over `group` as `plan` says. Every check
/// (names, module types, sizes the group must divide) runs before anything
/// changes and before any collective: a bad plan leaves the module as it was.
ParallelizeResult parallelize(torch::nn::Module& module, Communicator& group, const ParallelPlan& plan);
/// Over the mesh's tensor axis.
ParallelizeResult parallelize(torch::nn::Module& module, const DeviceMesh& mesh, const ParallelPlan& plan);

/// `plan` in tensor mode `mode` over `group`, which the split parameters'
/// operators keep alive. Mode 1d is parallelize(module, *group, plan). Modes
/// 2d, 2.5d (q x q x `depth` ranks) and 3d (d x d x d) split every
/// activation as well as every weight (docs/tensor_parallel.md), so every
/// layer of the module runs in the grid's form, with the weights of the
/// layer modules of tensor_parallel_2d.h and tensor_parallel_3d.h:
///   - every torch::nn::Linear is named, columnwise or rowwise; in 3d a
///     columnwise layer takes its input on side A (the residual stream's)
///     and gives side B, a rowwise one the reverse. `fused` and `gather` as
///     in 1D: gather gives the whole output on every rank, for a loss every
///     rank computes alike (its bias stays whole);
///   - every LayerNorm (with its affine parameters) splits by itself, on
///     side A in 3d, and is not named;
///   - an Embedding named vocab_embedding takes the whole batch of ids, the
///     same on every rank of the group, and looks up this rank's batch block
///     (q x depth blocks; d^2 in 3d): it is where activations are split. Any
///     other Embedding looks up its ids as given (positions, broadcast over
///     the batch);
///   - any other submodule with parameters of its own, a LayerNorm without
///     them, and the replicated and sequence_shard styles are refused.
/// As in 1D, every check runs before anything changes and before any
/// collective; then the grid's groups are formed (collective over `group`).
ParallelizeResult parallelize(torch::nn::Module& module, std::shared_ptr<Communicator> group, const ParallelPlan& plan,
                              TensorMode mode, int depth = 1);

}  // namespace strata::parallel
