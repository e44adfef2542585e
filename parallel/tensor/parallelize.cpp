// parallelize(): a plan of styles applied to an unmodified module's Linear
// and Embedding layers (parallelize.h), and the placements that give
// operators on the split weights their tensor-parallel form (Note
// [Tensor-parallel operators on unmodified modules] in parallel/dispatch/placement.h).
#include "strata/parallel/parallelize.h"

#include <fnmatch.h>

#include <cmath>

#include <unordered_set>

#include "strata/core/enum_names.h"
#include "strata/core/error.h"
#include "strata/parallel/tensor_parallel.h"
#include "parallelize_parts.h"
#include "../dispatch/placement.h"

namespace strata::parallel {

namespace {

constexpr EnumName<TensorMode> kTensorModeNames[] = {
    {TensorMode::k1D, "1d"}, {TensorMode::k2D, "2d"}, {TensorMode::k2_5D, "2.5d"}, {TensorMode::k3D, "3d"}};

}  // namespace

TensorMode parse_tensor_mode(const std::string& name) {
  return parse_enum(kTensorModeNames, name, "tensor-parallel mode", "choose");
}

const char* tensor_mode_name(TensorMode mode) { return enum_name(kTensorModeNames, mode); }

int tensor_grid_side(TensorMode mode, int size, int depth) {
  if (size < 1 || depth < 1 || (depth > 1 && mode != TensorMode::k2_5D)) return 0;
  if (mode == TensorMode::k1D) return size;
  if (mode == TensorMode::k3D) {
    const int d = static_cast<int>(std::lround(std::cbrt(static_cast<double>(size))));
    return d * d * d == size ? d : 0;
  }
  if (size % depth != 0) return 0;
  const int q = static_cast<int>(std::lround(std::sqrt(static_cast<double>(size / depth))));
  return q * q * depth == size ? q : 0;
}

namespace tensor_layout {

c10::optional<at::Tensor> SummedAdd::add(const at::Tensor& self, const at::Tensor& param, const c10::Scalar& alpha,
                                         bool in_place) const {
  const torch::Tensor p = copy_to_group(param, *group);
  if (!in_place) return torch::add(self, p, alpha);
  torch::Tensor s = self;
  return s.add_(p, alpha);
}

namespace {

bool matches(const std::string& pattern, const std::string& name) {
  auto atoms = [](const std::string& s) {
    std::vector<std::string> out;
    size_t from = 0;
    for (size_t dot; (dot = s.find('.', from)) != std::string::npos; from = dot + 1) out.push_back(s.substr(from, dot - from));
    out.push_back(s.substr(from));
    return out;
  };
  const std::vector<std::string> p = atoms(pattern), n = atoms(name);
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (fnmatch(p[i].c_str(), n[i].c_str(), 0) != 0) return false;
  }
  return true;
}

}  // namespace

const char* kind_name(ParallelStyle::Kind k) {
  switch (k) {
    case ParallelStyle::Kind::kColumnwise: return "columnwise";
    case ParallelStyle::Kind::kRowwise: return "rowwise";
    case ParallelStyle::Kind::kVocabEmbedding: return "vocab_embedding";
    case ParallelStyle::Kind::kReplicated: return "replicated";
    case ParallelStyle::Kind::kSequenceShard: return "sequence_shard";
  }
  return "?";
}

std::vector<int> match_plan(const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& named,
                            const ParallelPlan& plan) {
  std::vector<int> chosen(named.size(), -1);
  std::vector<bool> used(plan.size(), false);
  for (size_t n = 0; n < named.size(); ++n) {
    const std::string& name = named[n].key();
    for (size_t i = 0; i < plan.size(); ++i) {
      if (!matches(plan[i].first, name)) continue;
      STRATA_CHECK(chosen[n] < 0, "submodule ", name, " matches two plan entries, \"", plan[chosen[n]].first,
                   "\" and \"", plan[i].first, "\"; make the patterns disjoint");
      chosen[n] = static_cast<int>(i);
      used[i] = true;
    }
  }
  for (size_t i = 0; i < plan.size(); ++i) {
    STRATA_CHECK(used[i], "plan entry \"", plan[i].first, "\" matches no submodule of the module; names look like \"",
                 named.is_empty() ? std::string("(none)") : named.begin()->key(), "\" (named_modules())");
  }
  return chosen;
}

int64_t parameter_elements(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

void check_unsplit(const torch::Tensor& param, const std::string& module) {
  STRATA_CHECK(!param.key_set().has(c10::DispatchKey::TESTING_ONLY_GenericMode), "submodule ", module,
               "'s parameters belong to an attached engine; call parallelize before attach");
  STRATA_CHECK(tensor_group_of(param) == nullptr, "submodule ", module,
               " is already split over a tensor group; parallelize a module once");
}

void replace_data(torch::Tensor& param, const torch::Tensor& part) {
  torch::NoGradGuard no_grad;
  param.set_data(part.clone());
  if (param.grad().defined()) param.mutable_grad() = torch::Tensor();
}

}  // namespace tensor_layout

namespace {

using tensor_layout::Placement;
using tensor_layout::SummedAdd;
using tensor_layout::kind_name;

using Product = std::function<torch::Tensor(const torch::Tensor&)>;

torch::Tensor plus(const torch::Tensor& y, const c10::optional<torch::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? y + *bias : y;
}

// Note [Megatron's f and g] in layers_1d.cpp, on the weights of unmodified layers.
// Column-wise: W's rows (output features) are this rank's. The input's
// gradient is all-reduced (f); the output is this rank's slice of the
// features, or gathered whole (then the bias is whole too, added after).
// With sequence parallelism the input is a sequence shard, all-gathered
// (its backward reduce-scatter sums the input's gradient instead of f).
struct ColumnLinear final : Placement {
  Communicator* group;
  bool gather;
  int64_t sequence_dim;  // -1: none
  ColumnLinear(Communicator& g, bool gather_output, int64_t seq) : group(&g), gather(gather_output), sequence_dim(seq) {}
  c10::optional<torch::Tensor> linear(const torch::Tensor& x, const std::function<torch::Tensor()>& /*weight*/,
                                      const Product& local_product,
                                      const c10::optional<torch::Tensor>& bias) const override {
    const torch::Tensor in = sequence_dim >= 0 ? gather_sequence(x, *group, sequence_dim) : copy_to_group(x, *group);
    torch::Tensor y = local_product(in);
    return plus(gather ? gather_from_group(y, *group) : y, bias);
  }
};

// Row-wise: W's columns (input features) are this rank's; the partial
// products are all-reduced (g) and the whole bias added once.
// With sequence parallelism the sum is reduce-scattered along the sequence,
// and the bias, added to a shard, gets its gradient summed over the group.
struct RowLinear final : Placement {
  Communicator* group;
  int64_t local_in, sequence_dim;
  RowLinear(Communicator& g, int64_t in_part, int64_t seq) : group(&g), local_in(in_part), sequence_dim(seq) {}
  c10::optional<torch::Tensor> linear(const torch::Tensor& x, const std::function<torch::Tensor()>& /*weight*/,
                                      const Product& local_product,
                                      const c10::optional<torch::Tensor>& bias) const override {
    const int64_t p = group->world_size();
    STRATA_CHECK(x.size(-1) == local_in || x.size(-1) == local_in * p, "a row-wise layer of ", local_in * p,
                 " input features split over ", p, " ranks got an input of ", x.size(-1),
                 " features: give it the whole input or this rank's slice (a column-wise layer's output)");
    const torch::Tensor part = x.size(-1) == local_in && p > 1 ? x : scatter_to_group(x, *group);
    if (sequence_dim < 0) return plus(reduce_from_group(local_product(part), *group), bias);
    const torch::Tensor y = reduce_scatter_sequence(local_product(part), *group, sequence_dim);
    return bias.has_value() && bias->defined() ? y + copy_to_group(*bias, *group) : y;
  }
};

// Vocabulary rows: lookups masked and all-reduced; as an output projection
// (tied embeddings) a column-wise linear, its logits gathered or kept split.
struct VocabEmbedding final : Placement {
  Communicator* group;
  int64_t begin;
  bool gather_logits;
  int64_t sequence_dim;  // -1: none; else lookups reduce-scattered along it
  VocabEmbedding(Communicator& g, int64_t vocab_begin, bool gather, int64_t seq)
      : group(&g), begin(vocab_begin), gather_logits(gather), sequence_dim(seq) {}
  c10::optional<torch::Tensor> linear(const torch::Tensor& x, const std::function<torch::Tensor()>& weight,
                                      const Product& local_product,
                                      const c10::optional<torch::Tensor>& bias) const override {
    return ColumnLinear(*group, gather_logits, sequence_dim).linear(x, weight, local_product, bias);
  }
  c10::optional<torch::Tensor> embedding(const torch::Tensor& weight, const torch::Tensor& ids, int64_t padding_idx,
                                         bool, bool) const override {
    return vocab_parallel_embedding(weight, ids, begin, *group, padding_idx, sequence_dim);
  }
};

// Whole on every rank, used on sequence shards: its gradient is summed over
// the group. A LayerNorm normalises its shard's rows; an Embedding (of
// positions) keeps this rank's 1/P of its output along `dim`.
struct SequenceShard final : Placement {
  Communicator* group;
  int64_t dim;
  SequenceShard(Communicator& g, int64_t d) : group(&g), dim(d) {}
  c10::optional<torch::Tensor> layer_norm(const torch::Tensor& x, c10::IntArrayRef shape, const torch::Tensor& weight,
                                          const c10::optional<torch::Tensor>& bias, double eps) const override {
    const c10::optional<torch::Tensor> b =
        bias.has_value() && bias->defined() ? c10::optional<torch::Tensor>(copy_to_group(*bias, *group)) : c10::nullopt;
    return torch::layer_norm(x, shape, copy_to_group(weight, *group), b, eps);
  }
  c10::optional<torch::Tensor> embedding(const torch::Tensor& weight, const torch::Tensor& ids, int64_t padding_idx,
                                         bool scale_grad_by_freq, bool sparse) const override {
    const torch::Tensor rows =
        torch::embedding(copy_to_group(weight, *group), ids, padding_idx, scale_grad_by_freq, sparse);
    const int64_t d = dim < 0 ? dim + rows.dim() : dim;
    const auto [b, e] = slice_of(rows.size(d), *group, "the sequence dimension of a position embedding's output");
    return rows.narrow(d, b, e - b);
  }
};

// The embedding dim split: lookups give this rank's slice of each row.
struct ColumnEmbedding final : Placement {
  Communicator* group;
  bool gather;
  ColumnEmbedding(Communicator& g, bool gather_output) : group(&g), gather(gather_output) {}
  c10::optional<torch::Tensor> embedding(const torch::Tensor& weight, const torch::Tensor& ids, int64_t padding_idx,
                                         bool scale_grad_by_freq, bool sparse) const override {
    torch::Tensor y = torch::embedding(weight, ids, padding_idx, scale_grad_by_freq, sparse);
    return gather ? gather_from_group(y, *group) : y;
  }
};

// One matched submodule: what to keep of each parameter, checked before any change.
struct Cut {
  std::string name;
  ParallelStyle style;
  torch::Tensor weight, bias;
  torch::Tensor new_weight, new_bias;  // this rank's parts
  checkpoint::PartMap weight_map, bias_map;  // where they lie in the whole (Note [Parts of a whole parameter])
  std::shared_ptr<const Placement> placement;
  bool bias_split = false;
  std::shared_ptr<const Placement> bias_placement;  // a whole bias whose operators change (sequence parallel)
  bool keep_shape = false;  // sequence_shard: whole on every rank, only its operators change
  int copies = 1;           // ranks of the group holding the same part
};

// Rows [begin, end) of each of `fused` equal blocks along dim 0, concatenated.
tensor_layout::Cut fused_rows(int fused, Communicator& g, const std::string& what) {
  return [fused, &g, what](const torch::Tensor& t) {
    const int64_t block = t.size(0) / fused;
    std::vector<torch::Tensor> parts;
    for (int k = 0; k < fused; ++k) {
      const auto [b, e] = slice_of(block, g, what.c_str());
      parts.push_back(t.narrow(0, k * block + b, e - b));
    }
    return torch::cat(parts, 0);
  };
}

// Elements [b, e) of dimension `dim`.
tensor_layout::Cut narrowed(int64_t dim, int64_t b, int64_t e) {
  return [=](const torch::Tensor& t) { return t.narrow(dim, b, e - b); };
}

Cut plan_cut(torch::nn::Module& m, const std::string& name, const ParallelStyle& style, Communicator& g) {
  Cut c;
  c.name = name;
  c.style = style;
  const int64_t seq = style.sequence_parallel ? style.sequence_dim : -1;
  STRATA_CHECK(!style.sequence_parallel || style.sequence_dim >= 0, "submodule ", name,
               ": the sequence dimension must be 0 or more (got ", style.sequence_dim, ")");
  auto* linear = m.as<torch::nn::Linear>();
  auto* embedding = m.as<torch::nn::Embedding>();
  const std::string where = "submodule " + name + " (" + kind_name(style.kind) + ")";
  switch (style.kind) {
    case ParallelStyle::Kind::kReplicated:
      return c;
    case ParallelStyle::Kind::kSequenceShard: {
      auto* norm = m.as<torch::nn::LayerNorm>();
      STRATA_CHECK(norm != nullptr || embedding != nullptr, where, " is a ", m.name(), "; the sequence_shard style "
                   "applies to a torch::nn::LayerNorm or an Embedding (of positions)");
      STRATA_CHECK(norm == nullptr || norm->options.elementwise_affine(), where, ": a LayerNorm without a weight has "
                   "nothing to split; leave it out of the plan");
      c.weight = norm != nullptr ? norm->weight : embedding->weight;
      c.bias = norm != nullptr ? norm->bias : torch::Tensor();
      c.keep_shape = true;
      c.copies = g.world_size();
      c.placement = std::make_shared<SequenceShard>(g, style.sequence_dim);
      return c;
    }
    case ParallelStyle::Kind::kColumnwise: {
      STRATA_CHECK(linear != nullptr || embedding != nullptr, where, " is a ", m.name(),
                   "; the column-wise style splits a torch::nn::Linear or Embedding");
      STRATA_CHECK(style.fused >= 1, where, ": fused must be at least 1 (got ", style.fused, ")");
      STRATA_CHECK(style.fused == 1 || !style.gather_output, where, ": fused blocks and a gathered output do not "
                   "go together (the gather would interleave the blocks' slices); keep the output split, or split "
                   "the fused layer into one linear per block");
      if (linear != nullptr) {
        c.weight = linear->weight;
        c.bias = linear->bias;
        const int64_t out = c.weight.size(0);
        STRATA_CHECK(out % style.fused == 0, where, ": its ", out, " output features are not ", style.fused,
                     " equal fused blocks");
        const std::string what = "the output features of " + name + (style.fused > 1 ? " (per fused block)" : "");
        c.new_weight = tensor_layout::cut_part(c.weight, fused_rows(style.fused, g, what), &c.weight_map);
        // Gathered output: the bias stays whole, added after the gather.
        c.bias_split = !style.gather_output;
        if (c.bias.defined() && c.bias_split) {
          c.new_bias = tensor_layout::cut_part(c.bias, fused_rows(style.fused, g, what), &c.bias_map);
        }
        c.placement = std::make_shared<ColumnLinear>(g, style.gather_output, seq);
      } else {
        c.weight = embedding->weight;
        STRATA_CHECK(style.fused == 1, where, ": an embedding has no fused blocks");
        const auto [b, e] = slice_of(c.weight.size(1), g, ("the embedding dim of " + name).c_str());
        c.new_weight = tensor_layout::cut_part(c.weight, narrowed(1, b, e), &c.weight_map);
        STRATA_CHECK(seq < 0, where, ": an embedding split by dim takes no sequence dimension");
        c.placement = std::make_shared<ColumnEmbedding>(g, style.gather_output);
      }
      return c;
    }
    case ParallelStyle::Kind::kRowwise: {
      STRATA_CHECK(linear != nullptr, where, " is a ", m.name(), "; the row-wise style splits a torch::nn::Linear "
                   "(for an embedding's vocabulary use vocab_embedding)");
      c.weight = linear->weight;
      c.bias = linear->bias;  // whole: added once, after the all-reduce
      const auto [b, e] = slice_of(c.weight.size(1), g, ("the input features of " + name).c_str());
      c.new_weight = tensor_layout::cut_part(c.weight, narrowed(1, b, e), &c.weight_map);
      c.placement = std::make_shared<RowLinear>(g, e - b, seq);
      if (seq >= 0 && c.bias.defined()) c.bias_placement = std::make_shared<SummedAdd>(g);
      return c;
    }
    case ParallelStyle::Kind::kVocabEmbedding: {
      STRATA_CHECK(embedding != nullptr, where, " is a ", m.name(), "; the vocab_embedding style splits a "
                   "torch::nn::Embedding's rows");
      STRATA_CHECK(!embedding->options.max_norm().has_value(), where, ": max_norm renormalises whole rows in place; "
                   "a split vocabulary cannot do that here");
      c.weight = embedding->weight;
      const auto [b, e] = slice_of(c.weight.size(0), g, ("the vocabulary of " + name).c_str());
      c.new_weight = tensor_layout::cut_part(c.weight, narrowed(0, b, e), &c.weight_map);
      c.placement = std::make_shared<VocabEmbedding>(g, b, style.gather_output, seq);
      return c;
    }
  }
  return c;
}

}  // namespace

ParallelizeResult parallelize(torch::nn::Module& module, Communicator& group, const ParallelPlan& plan) {
  ParallelizeResult result;
  result.full_params = tensor_layout::parameter_elements(module);
  const auto named = module.named_modules("", /*include_self=*/false);
  const std::vector<int> chosen = tensor_layout::match_plan(named, plan);
  std::vector<Cut> cuts;
  std::unordered_set<const c10::TensorImpl*> weights;
  size_t at = 0;
  for (const auto& item : named) {
    const int entry = chosen[at++];
    if (entry < 0) continue;
    Cut c = plan_cut(*item.value(), item.key(), plan[entry].second, group);
    if (!c.weight.defined()) continue;  // replicated
    tensor_layout::check_unsplit(c.weight, item.key());
    STRATA_CHECK(weights.insert(c.weight.unsafeGetTensorImpl()).second, "submodule ", item.key(),
                 " shares its weight with another submodule of the plan; name only one of them (a linear that uses a "
                 "vocab_embedding's weight is split with it)");
    cuts.push_back(std::move(c));
  }
  // Every check passed: change the module.
  for (Cut& c : cuts) {
    using checkpoint::PartMap;
    if (!c.keep_shape) tensor_layout::replace_data(c.weight, c.new_weight);
    tensor_layout::place(c.weight, group, c.copies, c.placement,
                         c.keep_shape ? PartMap::whole(c.weight.sizes().vec()) : c.weight_map);
    if (c.keep_shape && c.bias.defined()) {  // whole: counted once
      tensor_layout::place(c.bias, group, c.copies, nullptr, PartMap::whole(c.bias.sizes().vec()));
    }
    if (c.bias_placement != nullptr) {
      tensor_layout::place(c.bias, group, group.world_size(), c.bias_placement, PartMap::whole(c.bias.sizes().vec()));
    }
    if (c.bias.defined() && c.bias_split) {
      tensor_layout::replace_data(c.bias, c.new_bias);
      tensor_layout::place(c.bias, group, 1, nullptr, c.bias_map);
    }
    result.split.push_back(c.name);
  }
  result.local_params = tensor_layout::parameter_elements(module);
  return result;
}

ParallelizeResult parallelize(torch::nn::Module& module, const DeviceMesh& mesh, const ParallelPlan& plan) {
  return parallelize(module, *mesh.group(DeviceMesh::kTensor), plan);
}

}  // namespace strata::parallel
