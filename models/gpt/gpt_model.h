#pragma once
// A decoder-only transformer written with plain LibTorch modules, and its
// byte-level corpus: the model examples/gpt trains and `strata bench step`
// measures, so the benchmark measures what the example runs.

#include <torch/torch.h>

#include <string>
#include <vector>

#include "strata/parallel/parallelize.h"
#include "strata/parallel/sequence_parallel.h"

namespace strata::examples {

struct GptConfig {
  int vocab = 256;  // bytes
  int context = 64;
  int dim = 128;
  int layers = 4;
  int heads = 4;
  /// Activation checkpointing per block: each block's activations are
  /// recomputed in backward instead of kept (strata::parallel::checkpoint).
  bool checkpoint_blocks = false;
  /// Activation offload per block: each block's saved activations wait in
  /// host memory until its backward (strata::parallel::offload_activations).
  bool offload_blocks = false;
  /// The output projection tied to the token embedding (false: a head of
  /// its own). The head registers the first layer's table as "<L+1>.tok"
  /// too, so a pipeline cutting them apart ties the two stages' copies; a
  /// plain LibTorch optimizer takes unique_parameters(). A 2D/2.5D/3D table
  /// cannot be a linear layer's weight. So false by default; examples/gpt
  /// ties it except in the grid modes.
  bool tied_head = false;
  /// Sequence parallelism: this rank holds some of each sequence's
  /// positions. Every block's attention runs through it, and the embedding
  /// takes the global positions of the rank's own from it; a module, so a
  /// parallel::Trainer finds it (parallel::sequence_attention(mesh, plan)).
  /// Null: the whole sequence.
  strata::parallel::sequence::Attention sequence_attention{nullptr};
};

struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(int dim, int heads);
  /// `mask` undefined: the causal mask of q's positions, made here (under
  /// Megatron's sequence parallelism x holds fewer positions than q).
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask);

  int heads;
  int64_t head_dim;  // dim / heads
  /// GptConfig::attention, or null.
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)> attention;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(GptBlock);

/// The GPT: a torch::nn::Sequential of layers, the one definition every
/// layout trains (parallel::Trainer cuts it into pipeline stages, splits it by
/// gpt_layers_tensor_parallel_plan, shards its sequences): layer 0 the
/// embedding (tokens and positions: "0.tok", "0.pos"), layers 1..L the
/// blocks ("<i>.block.qkv", ...), layer L + 1 the head (final norm "<L+1>.ln"
/// and the output projection: untied "<L+1>.out", tied "<L+1>.tok", the
/// embedding's table again). Token ids [batch, time]
/// in, logits [batch, time, vocab] out. Matrices N(0, 0.02), vectors zero,
/// LayerNorms as built.
torch::nn::Sequential gpt_layers(const GptConfig& config);
/// Mean cross-entropy of next-byte prediction from logits (the pipeline's loss).
torch::Tensor gpt_loss(const torch::Tensor& logits, const torch::Tensor& y);

/// Tensor parallelism for gpt_layers(config), for strata::parallel::parallelize
/// and a HybridPlan's tensor layers: Megatron's split (q, k, v and the MLP's
/// first layer column-wise, their output projections row-wise, the token
/// embedding by vocabulary), the logits gathered whole (a tied head through
/// the vocabulary embedding, an untied one column-wise). The same plan serves
/// the 2D, 2.5D and 3D modes (untied only). `sequence_parallel`: Megatron's
/// sequence parallelism as well, the norms and the residual stream on 1/P of
/// the positions (the context must divide too).
strata::parallel::ParallelPlan gpt_layers_tensor_parallel_plan(const GptConfig& config, bool sequence_parallel = false);

/// Each parameter once, in named_parameters() order (LibTorch's parameters()
/// lists a tied table under both its names): what a plain LibTorch optimizer
/// and clip_grad_norm_ take.
std::vector<torch::Tensor> unique_parameters(torch::nn::Module& module);
/// The elements of unique_parameters(module).
int64_t count_parameters(torch::nn::Module& module);

/// `path`, or Debian's fortunes-min corpus (/usr/share/games/fortunes) when
/// empty, as a 1-D int64 tensor of bytes. Throws strata::Error saying what to
/// install or pass when there is no usable text.
torch::Tensor load_corpus(const std::string& path);

/// A model size written DIMxLAYERS (e.g. 256x4), with `context`.
GptConfig parse_gpt_size(const std::string& size, int context);

/// `batch` random windows of `context` bytes and the bytes that follow them.
std::pair<torch::Tensor, torch::Tensor> sample_batch(const torch::Tensor& corpus, int batch, int context);

}  // namespace strata::examples
