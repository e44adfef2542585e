#include "gpt_model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_set>
#include <vector>

#include "strata/core/error.h"
#include "strata/parallel/activation_checkpoint.h"
#include "strata/parallel/activation_offload.h"

namespace strata::examples {

GptBlockImpl::GptBlockImpl(int dim, int heads_) : heads(heads_), head_dim(dim / heads_) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
  proj = register_module("proj", torch::nn::Linear(dim, dim));
  up = register_module("up", torch::nn::Linear(dim, 4 * dim));
  down = register_module("down", torch::nn::Linear(4 * dim, dim));
}

namespace {

// Made where the activations are: the GPU under CUDA (Engine::device()), so
// the model runs unchanged on a GPU and on the CPU.
torch::Tensor causal_mask(int64_t t, const torch::Device& device) {
  return torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(device)).triu(1);
}

torch::Tensor positions_of(int64_t t, const torch::Device& device) {
  return torch::arange(t, torch::TensorOptions().dtype(torch::kLong).device(device));
}

}  // namespace

torch::Tensor GptBlockImpl::forward(torch::Tensor x, const torch::Tensor& mask) {
  // Heads and positions counted from the tensors: under tensor parallelism
  // (the plan gpt_layers_tensor_parallel_plan) qkv's output holds this rank's heads
  // only, and with sequence parallelism x holds this rank's positions while
  // qkv's output holds all of them. The head width is the model's: in the 2D
  // and 3D modes x holds a block of the features too.
  const int64_t b = x.size(0), hd = head_dim;
  auto parts = qkv->forward(ln1->forward(x)).chunk(3, -1);
  auto split = [&](const torch::Tensor& y) { return y.view({b, y.size(1), -1, hd}).transpose(1, 2); };
  torch::Tensor q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
  torch::Tensor y;
  if (attention) {
    y = attention(q, k, v);  // sequence parallel: causal over the whole sequence
  } else {
    torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    att = torch::softmax(att.masked_fill(mask.defined() ? mask : causal_mask(q.size(2), q.device()), -1e4), -1);
    y = torch::matmul(att, v);
  }
  x = x + proj->forward(y.transpose(1, 2).contiguous().view({b, y.size(2), -1}));
  return x + down->forward(torch::gelu(up->forward(ln2->forward(x))));
}

namespace {

// The GPT's initialisation: N(0, 0.02) matrices, zero vectors, LayerNorm (names with "ln") as built.
void init_like_gpt(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> seen;  // a tied table once, under its first name
  for (auto& p : m.named_parameters()) {
    if (!seen.insert(p.value().unsafeGetTensorImpl()).second) continue;
    if (p.key().find("ln") != std::string::npos) continue;
    if (p.value().dim() >= 2) {
      p.value().normal_(0.0, 0.02);
    } else {
      p.value().zero_();
    }
  }
}

// One block's forward: its activations recomputed in backward (checkpointed),
// kept in host memory until then (offloaded), or kept.
torch::Tensor run_block(GptBlockImpl* block, const torch::Tensor& x, const torch::Tensor& mask, bool checkpointed,
                        bool offloaded) {
  const auto fn = [block, mask](const torch::Tensor& h) { return block->forward(h, mask); };
  if (checkpointed) return strata::parallel::checkpoint(fn, x);
  if (offloaded) return strata::parallel::offload_activations(fn, x);
  return fn(x);
}

}  // namespace

namespace {

struct GptEmbeddingImpl : torch::nn::Module {
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  strata::parallel::sequence::Attention attention{nullptr};  // sequence parallel: the global positions
  GptEmbeddingImpl(int vocab, int context, int dim, strata::parallel::sequence::Attention a) : attention(std::move(a)) {
    tok = register_module("tok", torch::nn::Embedding(vocab, dim));
    pos = register_module("pos", torch::nn::Embedding(context, dim));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    const int64_t t = idx.size(1);
    return tok->forward(idx) + pos->forward(attention ? attention->positions(t).to(idx.device()) : positions_of(t, idx.device()));
  }
};
TORCH_MODULE(GptEmbedding);

// A block that builds its own causal mask (GptBlockImpl::forward): one
// tensor in, one out. With a sequence-parallel attention it holds it as a
// submodule, where a Trainer looks for it.
struct GptStageBlockImpl : torch::nn::Module {
  GptBlock block{nullptr};
  bool checkpointed, offloaded;
  GptStageBlockImpl(int dim, int heads, bool checkpoint, bool offload, strata::parallel::sequence::Attention a)
      : checkpointed(checkpoint), offloaded(offload) {
    block = register_module("block", GptBlock(dim, heads));
    if (a) {
      register_module("attention", a);
      block->attention = [a](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) mutable {
        return a->forward(q, k, v);
      };
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return run_block(block.get(), x, torch::Tensor(), checkpointed, offloaded); }
};
TORCH_MODULE(GptStageBlock);

// The final norm and the output projection: a Linear of its own, or tied
// to the embedding's table, registered here as "tok" too, so that a pipeline
// cutting the head onto another stage ties the two (Note [Parameters across
// stages]); its first name stays "0.tok.weight".
struct GptHeadImpl : torch::nn::Module {
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear out{nullptr};
  torch::nn::Embedding tied{nullptr};
  GptHeadImpl(int dim, int vocab, torch::nn::Embedding tok) : tied(std::move(tok)) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    if (tied) {
      register_module("tok", tied);
    } else {
      out = register_module("out", torch::nn::Linear(torch::nn::LinearOptions(dim, vocab).bias(false)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return tied ? torch::nn::functional::linear(ln->forward(x), tied->weight) : out->forward(ln->forward(x));
  }
};
TORCH_MODULE(GptHead);

}  // namespace

torch::nn::Sequential gpt_layers(const GptConfig& c) {
  STRATA_CHECK(c.dim % c.heads == 0, "the model width (", c.dim, ") must be a multiple of the heads (", c.heads, ")");
  torch::nn::Sequential s;
  GptEmbedding embedding(c.vocab, c.context, c.dim, c.sequence_attention);
  s->push_back(embedding);
  for (int i = 0; i < c.layers; ++i) {
    s->push_back(GptStageBlock(c.dim, c.heads, c.checkpoint_blocks, c.offload_blocks, c.sequence_attention));
  }
  s->push_back(GptHead(c.dim, c.vocab, c.tied_head ? embedding->tok : torch::nn::Embedding{nullptr}));
  init_like_gpt(*s);
  return s;
}

torch::Tensor gpt_loss(const torch::Tensor& logits, const torch::Tensor& y) {
  return torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

strata::parallel::ParallelPlan gpt_layers_tensor_parallel_plan(const GptConfig& c, bool sequence_parallel) {
  using strata::parallel::ParallelStyle;
  const auto seq = [&](ParallelStyle s) { return sequence_parallel ? s.along_sequence(1) : s; };
  const std::string head = std::to_string(c.layers + 1);
  strata::parallel::ParallelPlan plan = {
      {"*.block.qkv", seq(ParallelStyle::columnwise(/*fused=*/3))},
      {"*.block.proj", seq(ParallelStyle::rowwise())},
      {"*.block.up", seq(ParallelStyle::columnwise())},
      {"*.block.down", seq(ParallelStyle::rowwise())},
      // Tied: the head's projection through the table is column-wise, its logits gathered whole.
      {"0.tok", seq(ParallelStyle::vocab_embedding(/*gather_tied_logits=*/c.tied_head))}};
  if (!c.tied_head) plan.push_back({head + ".out", seq(ParallelStyle::columnwise(1, /*gather_output=*/true))});
  if (sequence_parallel) {
    plan.push_back({"*.block.ln*", ParallelStyle::sequence_shard()});
    plan.push_back({head + ".ln", ParallelStyle::sequence_shard()});
    plan.push_back({"0.pos", ParallelStyle::sequence_shard(/*dim=*/0)});
  }
  return plan;
}

std::vector<torch::Tensor> unique_parameters(torch::nn::Module& module) {
  std::vector<torch::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

int64_t count_parameters(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : unique_parameters(module)) n += p.numel();
  return n;
}

torch::Tensor load_corpus(const std::string& path) {
  std::string text;
  auto slurp = [&](const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    text += ss.str();
  };
  if (!path.empty()) {
    STRATA_CHECK(std::filesystem::is_regular_file(path), "--data ", path, " is not a readable file");
    slurp(path);
  } else {
    const std::filesystem::path dir = "/usr/share/games/fortunes";
    STRATA_CHECK(std::filesystem::is_directory(dir), "no corpus: install Debian's fortunes-min (scripts/setup.sh "
                 "does) or pass --data FILE");
    // In name order, so that the corpus (and every loss and sample) is the
    // same whatever order the file system lists the directory in; the .dat
    // indexes are not text, and NAME.u8 is NAME again in UTF-8 (the same bytes
    // for ASCII files), so it is read only where NAME is missing.
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      const std::filesystem::path& f = e.path();
      if (!e.is_regular_file() || f.extension() == ".dat") continue;
      if (f.extension() == ".u8" && std::filesystem::exists(std::filesystem::path(f).replace_extension())) continue;
      files.push_back(f);
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) slurp(f);
  }
  STRATA_CHECK(text.size() > 1024, "the corpus has only ", text.size(), " bytes; give a larger --data file");
  return torch::from_blob(text.data(), {static_cast<int64_t>(text.size())}, torch::kUInt8).to(torch::kLong);
}

std::pair<torch::Tensor, torch::Tensor> sample_batch(const torch::Tensor& corpus, int batch, int context) {
  const int64_t n = corpus.size(0) - context - 1;
  STRATA_CHECK(n > 0, "the corpus (", corpus.size(0), " bytes) is shorter than the context (", context, ")");
  const torch::Tensor starts = torch::randint(0, n, {batch});
  std::vector<torch::Tensor> xs, ys;
  for (int b = 0; b < batch; ++b) {
    const int64_t s = starts[b].item<int64_t>();
    xs.push_back(corpus.slice(0, s, s + context));
    ys.push_back(corpus.slice(0, s + 1, s + context + 1));
  }
  return {torch::stack(xs), torch::stack(ys)};
}

GptConfig parse_gpt_size(const std::string& s, int context) {
  GptConfig c;
  c.context = context;
  const auto x = s.find('x');
  STRATA_CHECK(x != std::string::npos, "size \"", s, "\" is not DIMxLAYERS, e.g. 256x4");
  try {
    c.dim = std::stoi(s.substr(0, x));
    c.layers = std::stoi(s.substr(x + 1));
  } catch (const std::exception&) {
    STRATA_FAIL("size \"", s, "\" is not DIMxLAYERS, e.g. 256x4");
  }
  STRATA_CHECK(c.dim > 0 && c.layers > 0 && c.dim % c.heads == 0, "size \"", s, "\": the width must be a positive ",
               "multiple of ", c.heads, " and the layers positive");
  return c;
}

}  // namespace strata::examples
