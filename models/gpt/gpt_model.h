#pragma once
// A decoder-only transformer written with plain LibTorch modules, and its
// byte-level corpus: the model examples/gpt trains and `strata bench step`
// measures, so the benchmark measures what the example runs.

#include <torch/torch.h>

#include <functional>
#include <string>

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
  /// The output projection tied to the token embedding (false: a head of its
  /// own, as the model as layers has).
  bool tied_head = true;
  /// Sequence parallelism (examples/gpt --sp): this rank holds some of each
  /// sequence's positions. `attention` replaces the causal softmax attention
  /// of q, k, v [batch, heads, local positions, head_dim] (a
  /// strata::parallel sequence-parallel attention over the group), and
  /// `positions(local)` gives the global positions of the rank's `local`
  /// ones for the position embedding. Null: one process, the whole sequence.
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)> attention;
  std::function<torch::Tensor(int64_t)> positions;
  /// The same for the model as layers (gpt_layers): a module, so a
  /// parallel::Trainer finds it (parallel::sequence_attention(mesh, plan)).
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

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptConfig& config);
  /// Logits [batch, time, vocab] for token ids [batch, time]; the output
  /// projection is tied to the input embedding.
  torch::Tensor forward(const torch::Tensor& idx);
  /// Mean cross-entropy of next-byte prediction.
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y);

  GptConfig config;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear head{nullptr};  // untied only
};
TORCH_MODULE(Gpt);

/// The same transformer as a torch::nn::Sequential of layers for pipeline
/// parallelism (strata::parallel::pipeline): embedding (tokens and
/// positions), the blocks, and a head (final norm and an output projection of
/// its own: a pipeline cannot tie it to an embedding on another stage).
/// Token ids [batch, time] in, logits [batch, time, vocab] out; initialised
/// as GptImpl's.
torch::nn::Sequential gpt_layers(const GptConfig& config);
/// Mean cross-entropy of next-byte prediction from logits (the pipeline's loss).
torch::Tensor gpt_loss(const torch::Tensor& logits, const torch::Tensor& y);

/// 1D tensor parallelism for GptImpl, for strata::parallel::parallelize:
/// Megatron's split (q, k, v and the MLP's first layer column-wise, their
/// output projections row-wise, the token embedding by vocabulary). The
/// heads and the vocabulary must divide by the group's size.
/// `sequence_parallel`: Megatron's sequence parallelism as well, the norms
/// and the residual stream on 1/P of the positions (the context must divide too).
strata::parallel::ParallelPlan gpt_tensor_parallel_plan(bool sequence_parallel = false);
/// The same split for gpt_layers(config) (its names: "0.tok", "<i>.block.qkv",
/// "<layers + 1>.out"), its head column-wise with the logits gathered whole.
strata::parallel::ParallelPlan gpt_layers_tensor_parallel_plan(const GptConfig& config, bool sequence_parallel = false);

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
