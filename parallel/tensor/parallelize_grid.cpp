// parallelize() in tensor modes 2d, 2.5d and 3d (parallelize.h): the grid
// layers' arithmetic (grid_ops.h) on an unmodified module's own parameters,
// through placements (Note [Tensor-parallel operators on unmodified modules]
// in parallel/dispatch/placement.h). The module's forward runs as written; its linear layers,
// norms and embeddings run as Linear2D/LayerNorm2D/... would, on the same
// parts of the same weights.
#include <fmt/format.h>

#include <memory>

#include "strata/core/error.h"
#include "strata/parallel/parallelize.h"
#include "strata/parallel/tensor_parallel.h"
#include "grid_ops.h"
#include "parallelize_parts.h"

namespace strata::parallel {

namespace {

using tensor_layout::Placement;
using Product = std::function<torch::Tensor(const torch::Tensor&)>;

// The grid every placement of one parallelize() call runs on, and the group
// it splits: alive while any parameter it placed is.
struct Grid {
  std::shared_ptr<Communicator> group;
  std::unique_ptr<TensorGrid> square;  // 2d, 2.5d
  std::unique_ptr<CubeGrid> cube;      // 3d
};

torch::Tensor or_none(const c10::optional<torch::Tensor>& t) { return t.has_value() ? *t : torch::Tensor(); }

// A Linear's weight: Linear2D's SUMMA, or Linear3D from `input_side`.
struct GridLinear final : Placement {
  std::shared_ptr<Grid> grid;
  Side3D input_side;
  bool gather;
  GridLinear(std::shared_ptr<Grid> g, Side3D side, bool gather_output)
      : grid(std::move(g)), input_side(side), gather(gather_output) {}
  c10::optional<torch::Tensor> linear(const torch::Tensor& x, const std::function<torch::Tensor()>& weight,
                                      const Product&, const c10::optional<torch::Tensor>& bias) const override {
    const torch::Tensor b = gather ? torch::Tensor() : or_none(bias);  // a gathered output's bias is whole
    torch::Tensor y = grid->square ? grid_ops::linear_2d(x, weight(), b, *grid->square)
                                   : grid_ops::linear_3d(x, weight(), b, *grid->cube, input_side);
    if (!gather) return y;
    y = grid->square ? grid_ops::gather_2d(y, *grid->square)
                     : grid_ops::gather_3d(y, *grid->cube, CubeGrid::other(input_side));
    // Not a view of a gather's buffer (a grid of one row returns its input
    // as is): the caller may add the bias to it in place.
    if (y.is_view()) y = y.clone();
    const torch::Tensor whole = or_none(bias);
    return whole.defined() ? y + whole : y;
  }
};

// A LayerNorm's weight: statistics over the row (2d) or the feature axis of side A (3d).
struct GridNorm final : Placement {
  std::shared_ptr<Grid> grid;
  explicit GridNorm(std::shared_ptr<Grid> g) : grid(std::move(g)) {}
  c10::optional<torch::Tensor> layer_norm(const torch::Tensor& x, c10::IntArrayRef shape, const torch::Tensor& weight,
                                          const c10::optional<torch::Tensor>& bias, double eps) const override {
    STRATA_CHECK(shape.size() == 1, "a grid-split LayerNorm normalises over the last dimension only");
    return grid->square ? grid_ops::layer_norm_2d(x, weight, or_none(bias), shape[0], eps, *grid->square)
                        : grid_ops::layer_norm_3d(x, weight, or_none(bias), shape[0], eps, *grid->cube, Side3D::kA);
  }
};

// An Embedding's table: `batch_ids` (the vocab_embedding style) takes the
// whole batch and looks up this rank's batch block; else the ids as given.
struct GridEmbedding final : Placement {
  std::shared_ptr<Grid> grid;
  bool batch_ids;
  int64_t vocab_begin;  // 2d with batch_ids: the vocabulary block's first id
  GridEmbedding(std::shared_ptr<Grid> g, bool whole_batch, int64_t begin)
      : grid(std::move(g)), batch_ids(whole_batch), vocab_begin(begin) {}
  c10::optional<torch::Tensor> embedding(const torch::Tensor& weight, const torch::Tensor& ids, int64_t padding_idx,
                                         bool scale_grad_by_freq, bool sparse) const override {
    STRATA_CHECK(padding_idx < 0 && !scale_grad_by_freq && !sparse, "a grid-split embedding takes no padding_idx, "
                 "scale_grad_by_freq or sparse gradients");
    if (grid->square) {
      TensorGrid& g = *grid->square;
      return batch_ids ? grid_ops::vocab_embedding_2d(weight, g.split_batch(ids), vocab_begin, g)
                       : grid_ops::embedding_2d(weight, ids, g);
    }
    CubeGrid& c = *grid->cube;
    return grid_ops::embedding_3d(weight, batch_ids ? c.split_batch(ids, Side3D::kA) : ids, c, Side3D::kA);
  }
};

enum class LayerKind { kLinear, kNorm, kEmbedding };

struct Job {
  std::string name;
  LayerKind kind;
  torch::nn::Module* module;
  ParallelStyle style;  // Linear: columnwise or rowwise; Embedding: vocab_embedding or not
};

std::string divisible(int64_t n, int64_t by) {
  return n % by == 0 ? std::string() : fmt::format("{} is not divisible by {}", n, by);
}

// Every check of one submodule, before anything changes: what it is, and sizes the grid divides.
c10::optional<Job> plan_job(torch::nn::Module& m, const std::string& name, int entry, const ParallelPlan& plan,
                            TensorMode mode, int blocks) {
  const bool cube = mode == TensorMode::k3D;
  const std::string where = fmt::format("submodule {} ({})", name, m.name());
  const std::string in_mode = fmt::format("in tensor mode {}", tensor_mode_name(mode));
  const auto sizes = [&](const std::string& what, const std::string& why) {
    STRATA_CHECK(why.empty(), where, ": ", in_mode, " the grid splits ", what, " into equal blocks, and ", why,
                 ": choose sizes the grid divides, or another mode");
  };
  Job job{name, LayerKind::kLinear, &m, entry >= 0 ? plan[entry].second : ParallelStyle{}};
  const ParallelStyle& s = job.style;
  if (auto* linear = m.as<torch::nn::Linear>()) {
    STRATA_CHECK(entry >= 0, where, " is a linear layer the plan does not name: ", in_mode, " every activation is "
                 "split, so every linear layer runs in the grid's form. Name it columnwise or rowwise",
                 cube ? " (in 3d columnwise takes side A, the residual stream's, and gives side B; rowwise the "
                        "reverse)" : "");
    STRATA_CHECK(s.kind == ParallelStyle::Kind::kColumnwise || s.kind == ParallelStyle::Kind::kRowwise, where,
                 " is named ", tensor_layout::kind_name(s.kind), "; ", in_mode,
                 " a linear layer is columnwise or rowwise");
    STRATA_CHECK(s.fused >= 1 && (s.fused == 1 || s.kind == ParallelStyle::Kind::kColumnwise), where,
                 ": fused blocks belong to a columnwise layer (fused >= 1)");
    STRATA_CHECK(s.fused == 1 || !s.gather_output, where, ": fused blocks and a gathered output do not go together");
    const int64_t out = linear->weight.size(0), in = linear->weight.size(1);
    sizes("the output features" + (s.fused > 1 ? fmt::format(" ({} fused blocks)", s.fused) : std::string()),
          divisible(out, static_cast<int64_t>(s.fused) * blocks));
    if (cube) sizes("each block of the output features (into d pieces)", divisible(out / blocks, blocks));
    sizes("the input features", divisible(in, blocks));
    return job;
  }
  if (auto* norm = m.as<torch::nn::LayerNorm>()) {
    job.kind = LayerKind::kNorm;
    STRATA_CHECK(entry < 0, where, " is named in the plan, but ", in_mode, " LayerNorms split by themselves: leave it "
                 "out of the plan");
    STRATA_CHECK(norm->options.elementwise_affine() && norm->options.normalized_shape().size() == 1, where, ": ",
                 in_mode, " a LayerNorm's statistics span the ranks of a row, which strata computes through its "
                 "weight: give it elementwise_affine and one normalised dimension");
    sizes("the normalised features", divisible(norm->options.normalized_shape()[0], blocks));
    return job;
  }
  if (auto* embedding = m.as<torch::nn::Embedding>()) {
    job.kind = LayerKind::kEmbedding;
    STRATA_CHECK(entry < 0 || s.kind == ParallelStyle::Kind::kVocabEmbedding ||
                     s.kind == ParallelStyle::Kind::kColumnwise,
                 where, " is named ", tensor_layout::kind_name(s.kind), "; ", in_mode, " an embedding is "
                 "vocab_embedding (the module's input: the whole batch of ids) or left out (ids as given)");
    STRATA_CHECK(!embedding->options.padding_idx().has_value() && !embedding->options.max_norm().has_value(),
                 where, ": ", in_mode, " an embedding takes no padding_idx or max_norm");
    const int64_t vocab = embedding->weight.size(0), dim = embedding->weight.size(1);
    if (cube) {
      sizes("the embedding dim (into d^3 pieces)", divisible(dim, static_cast<int64_t>(blocks) * blocks * blocks));
    } else if (s.kind == ParallelStyle::Kind::kVocabEmbedding) {
      sizes("the vocabulary", divisible(vocab, blocks));
      sizes("the embedding dim", divisible(dim, blocks));
    } else {
      sizes("the embedding dim (into q^2 pieces)", divisible(dim, static_cast<int64_t>(blocks) * blocks));
    }
    return job;
  }
  STRATA_CHECK(entry < 0, where, " is named in the plan, but ", in_mode, " the plan names linear layers and "
               "embeddings only");
  STRATA_CHECK(m.named_parameters(/*recurse=*/false).is_empty(), where, " has parameters of its own; ", in_mode,
               " every parameter must belong to a Linear, LayerNorm or Embedding the grid can split");
  return c10::nullopt;
}

}  // namespace

ParallelizeResult parallelize(torch::nn::Module& module, std::shared_ptr<Communicator> group, const ParallelPlan& plan,
                              TensorMode mode, int depth) {
  STRATA_CHECK(group != nullptr, "parallelize needs a tensor group");
  const bool cube = mode == TensorMode::k3D;
  STRATA_CHECK(depth == 1 || mode == TensorMode::k2_5D, "depth ", depth, " belongs to tensor mode 2.5d, not ",
               tensor_mode_name(mode));
  if (mode == TensorMode::k1D) return parallelize(module, *group, plan);
  // The grid's side, before any collective.
  const int p = group->world_size();
  const int blocks = tensor_grid_side(mode, p, depth);
  STRATA_CHECK(blocks > 0, "tensor mode ", tensor_mode_name(mode), " needs ",
               cube ? "d x d x d ranks (8, 27, ...)" : depth > 1 ? "q x q x depth ranks" : "q x q ranks",
               "; the tensor group has ", p, depth > 1 ? fmt::format(" at depth {}", depth) : std::string());
  ParallelizeResult result;
  result.full_params = tensor_layout::parameter_elements(module);
  const auto named = module.named_modules("", /*include_self=*/false);
  const std::vector<int> chosen = tensor_layout::match_plan(named, plan);
  std::vector<Job> jobs;
  STRATA_CHECK(module.named_parameters(/*recurse=*/false).is_empty(), "the module has parameters of its own; in "
               "tensor mode ", tensor_mode_name(mode), " every parameter must belong to a Linear, LayerNorm or Embedding");
  for (size_t i = 0; i < named.size(); ++i) {
    c10::optional<Job> job = plan_job(*named[i].value(), named[i].key(), chosen[i], plan, mode, blocks);
    if (!job) continue;
    for (const auto& param : job->module->named_parameters(/*recurse=*/false)) {
      tensor_layout::check_unsplit(param.value(), job->name);
    }
    jobs.push_back(std::move(*job));
  }
  // Every check passed: form the grid's groups, then change the module.
  auto grid = std::make_shared<Grid>();
  grid->group = group;
  if (cube) {
    grid->cube = std::make_unique<CubeGrid>(*group);
  } else {
    grid->square = std::make_unique<TensorGrid>(*group, depth);
  }
  TensorGrid* sq = grid->square.get();
  CubeGrid* cb = grid->cube.get();
  // Ranks holding the same part: a weight block is on every depth (2.5d); a
  // feature block of a bias or a norm on every batch block.
  const int weight_copies = sq ? depth : 1;
  const int vector_copies = sq ? sq->batch_blocks() : blocks * blocks;
  for (Job& job : jobs) {
    const std::string& name = job.name;
    if (job.kind == LayerKind::kLinear) {
      auto* linear = job.module->as<torch::nn::Linear>();
      const Side3D side = job.style.kind == ParallelStyle::Kind::kColumnwise ? Side3D::kA : Side3D::kB;
      const int fused = job.style.fused;
      checkpoint::PartMap map;
      tensor_layout::replace_data(linear->weight, tensor_layout::cut_part(linear->weight, [&](const torch::Tensor& t) {
        return sq ? grid_ops::linear_2d_part(t, *sq, fused, name) : grid_ops::linear_3d_part(t, *cb, side, fused, name);
      }, &map));
      tensor_layout::place(linear->weight, *group, weight_copies,
                           std::make_shared<GridLinear>(grid, side, job.style.gather_output), map);
      if (linear->bias.defined() && !job.style.gather_output) {
        tensor_layout::replace_data(linear->bias, tensor_layout::cut_part(linear->bias, [&](const torch::Tensor& t) {
          return sq ? grid_ops::features_2d_part(t, *sq, fused, name)
                    : grid_ops::linear_3d_bias_part(t, *cb, side, fused, name);
        }, &map));
        // Added apart from the product too (LibTorch 1.13's F::linear adds it
        // after the matmul): summed over the ranks of the other batch blocks.
        Communicator& across = sq ? sq->batch() : cb->plane(CubeGrid::piece_axis(side));
        tensor_layout::place(linear->bias, *group, vector_copies,
                             std::make_shared<tensor_layout::SummedAdd>(across, grid), map);
      }
    } else if (job.kind == LayerKind::kNorm) {
      auto* norm = job.module->as<torch::nn::LayerNorm>();
      checkpoint::PartMap map;
      for (torch::Tensor* v : {&norm->weight, &norm->bias}) {
        tensor_layout::replace_data(*v, tensor_layout::cut_part(*v, [&](const torch::Tensor& t) {
          return sq ? grid_ops::features_2d_part(t, *sq, 1, name) : grid_ops::features_3d_part(t, *cb, Side3D::kA, name);
        }, &map));
      }
      // The weight and the bias are cut alike.
      tensor_layout::place(norm->weight, *group, vector_copies, std::make_shared<GridNorm>(grid), map);
      tensor_layout::place(norm->bias, *group, vector_copies, nullptr, map);
    } else {
      auto* embedding = job.module->as<torch::nn::Embedding>();
      const bool vocab = job.style.kind == ParallelStyle::Kind::kVocabEmbedding;
      int64_t begin = 0;
      checkpoint::PartMap map;
      const torch::Tensor part = tensor_layout::cut_part(embedding->weight, [&](const torch::Tensor& t) {
        if (cb) return grid_ops::embedding_3d_part(t, *cb, Side3D::kA, name);
        return vocab ? grid_ops::vocab_embedding_2d_part(t, *sq, &begin, name) : grid_ops::embedding_2d_part(t, *sq, name);
      }, &map);
      tensor_layout::replace_data(embedding->weight, part);
      tensor_layout::place(embedding->weight, *group, weight_copies, std::make_shared<GridEmbedding>(grid, vocab, begin),
                           map);
    }
    result.split.push_back(name);
  }
  result.local_params = tensor_layout::parameter_elements(module);
  return result;
}

}  // namespace strata::parallel
