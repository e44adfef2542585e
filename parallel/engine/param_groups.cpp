// no_decay_group: the standard split of LLM recipes (no weight decay on
// biases, norm weights and embeddings), found by module type and name (a
// module whose type is named ...LayerNorm... or ...Embedding... counts, so the
// tensor-parallel layers do).

#include <torch/torch.h>

#include <memory>
#include <unordered_set>

#include "strata/parallel/engine.h"

namespace strata::parallel {

namespace {

bool is_norm(torch::nn::Module& m) {
  return m.as<torch::nn::LayerNormImpl>() || m.as<torch::nn::GroupNormImpl>() ||
         m.as<torch::nn::BatchNorm1dImpl>() || m.as<torch::nn::BatchNorm2dImpl>() ||
         m.as<torch::nn::BatchNorm3dImpl>() || m.as<torch::nn::InstanceNorm1dImpl>() ||
         m.as<torch::nn::InstanceNorm2dImpl>() || m.as<torch::nn::InstanceNorm3dImpl>() ||
         m.as<torch::nn::LocalResponseNormImpl>() ||
         m.name().find("LayerNorm") != std::string::npos;  // tensor-parallel norms (LayerNorm2D, LayerNorm3D)
}

bool is_embedding(torch::nn::Module& m) {
  return m.as<torch::nn::EmbeddingImpl>() || m.as<torch::nn::EmbeddingBagImpl>() ||
         m.name().find("Embedding") != std::string::npos;  // tensor-parallel embeddings
}

}  // namespace

ParamGroup no_decay_group(torch::nn::Module& module, const NoDecayOptions& which) {
  auto names = std::make_shared<std::unordered_set<std::string>>();
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    torch::nn::Module& m = *item.value();
    const bool take = (which.norms && is_norm(m)) || (which.embeddings && is_embedding(m));
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      const std::string full = item.key().empty() ? p.key() : item.key() + "." + p.key();
      const bool bias = p.key() == "bias" || glob_match("*bias", p.key());
      if (take || (which.biases && bias) || (which.one_dimensional && p.value().dim() <= 1)) names->insert(full);
      for (const std::string& pattern : which.extra_patterns) {
        if (glob_match(pattern, full)) names->insert(full);
      }
    }
  }
  ParamGroup g;
  g.name = "no_decay";
  g.weight_decay = 0.0;
  g.select = [names](const std::string& name, const std::vector<int64_t>&) { return names->count(name) != 0; };
  return g;
}

}  // namespace strata::parallel
