// hybrid_check: a small transformer trained through parallel::Trainer under
// a HybridPlan (dp x pp x tp x sp, ZeRO, offload budgets on every rank),
// against the same model trained by plain LibTorch in one process on every
// replica's batch. Run under `strata run -n <dp*pp*tp*sp>`:
//
//   hybrid_check [--dp D] [--pp P] [--tp T] [--tp-mode 1d|2d|2.5d|3d] [--depth K]
//                [--sp S] [--zero Z] [--schedule S] [--microbatches M] [--sp-mode M]
//                [--sequence-parallel] [--host-fraction F] [--steps N] [--batch B] [--tuple]
//
// Each step's loss must equal the reference's, every parameter this rank
// holds must equal its part of the reference's after the last step, and the
// trained model's evaluation output on a fixed batch must equal the
// reference's (relative 1e-5: microbatches and the ring change the summation
// order). The plan goes through its JSON form (HybridPlan::from_json).
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "strata/core/error.h"
#include "strata/parallel/device_mesh.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/plan.h"
#include "strata/parallel/trainer.h"

namespace {

using namespace strata::parallel;

constexpr int64_t kVocab = 32, kDim = 16, kHeads = 4, kContext = 16;

// Plain causal attention (the reference), or the plan's sequence attention.
// `mask`: the causal mask a tuple of layers carries (--tuple), else made here.
torch::Tensor attend(sequence::Attention a, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v, torch::Tensor mask = {}) {
  if (a) return a->forward(q, k, v);
  const int64_t t = q.size(2);
  if (!mask.defined()) mask = torch::ones({t, t}, torch::kBool).triu(1);
  torch::Tensor s = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  return torch::matmul(torch::softmax(s.masked_fill(mask, -1e9), -1), v);
}

struct EmbedImpl : torch::nn::Module {
  explicit EmbedImpl(sequence::Attention a) : attention(std::move(a)) {
    tok = register_module("tok", torch::nn::Embedding(kVocab, kDim));
    pos = register_module("pos", torch::nn::Embedding(kContext, kDim));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    const int64_t t = idx.size(1);
    const torch::Tensor positions =
        attention ? attention->positions(t) : torch::arange(t, torch::TensorOptions().dtype(torch::kLong));
    return tok->forward(idx) + pos->forward(positions.to(idx.device()));
  }
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  sequence::Attention attention;
};
TORCH_MODULE(Embed);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(sequence::Attention a) : attention(std::move(a)) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    // No bias: a key's bias moves every score of a query alike, so its exact
    // gradient is zero and Adam would turn rounding noise into updates.
    qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(kDim, 3 * kDim).bias(false)));
    proj = register_module("proj", torch::nn::Linear(kDim, kDim));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    up = register_module("up", torch::nn::Linear(kDim, 4 * kDim));
    down = register_module("down", torch::nn::Linear(4 * kDim, kDim));
    if (attention) register_module("attention", attention);
  }
  torch::Tensor forward(torch::Tensor x) { return run(std::move(x), {}); }
  torch::Tensor run(torch::Tensor x, const torch::Tensor& mask) {
    // Heads and positions from the tensors: tensor parallelism leaves this
    // rank's heads in qkv's output, Megatron's sequence parallelism this
    // rank's positions in x.
    const int64_t b = x.size(0), hd = kDim / kHeads;
    auto parts = qkv->forward(ln1->forward(x)).chunk(3, -1);
    auto split = [&](const torch::Tensor& y) { return y.reshape({b, y.size(1), -1, hd}).transpose(1, 2); };
    const torch::Tensor y = attend(attention, split(parts[0]), split(parts[1]), split(parts[2]), mask);
    x = x + proj->forward(y.transpose(1, 2).reshape({b, y.size(2), -1}));
    return x + down->forward(torch::gelu(up->forward(ln2->forward(x))));
  }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr};
  sequence::Attention attention;
};
TORCH_MODULE(Block);

struct HeadImpl : torch::nn::Module {
  HeadImpl() {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    out = register_module("out", torch::nn::Linear(kDim, kVocab));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out->forward(ln->forward(x)); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Head);

// --tuple: the same layers (the same parameters, names and initialisation)
// passing a std::vector of three tensors between them, as real models pass a
// mask or positions beside the hidden state: the hidden state, a second
// floating stream that carries gradients back, and the causal mask (bool, no
// gradient) that the embedding makes once and every block uses.
struct TupleEmbedImpl : EmbedImpl {
  using EmbedImpl::EmbedImpl;
  std::vector<torch::Tensor> forward(const torch::Tensor& idx) {
    const torch::Tensor h = EmbedImpl::forward(idx);
    const int64_t t = idx.size(1);
    return {h, 0.5 * h, torch::ones({t, t}, torch::kBool).triu(1)};
  }
};
TORCH_MODULE(TupleEmbed);

struct TupleBlockImpl : BlockImpl {
  using BlockImpl::BlockImpl;
  std::vector<torch::Tensor> forward(std::vector<torch::Tensor> v) {
    const torch::Tensor h = BlockImpl::run(v[0] + 0.1 * v[1], v[2]);
    return {h, 0.9 * v[1] + 0.1 * h, v[2]};
  }
};
TORCH_MODULE(TupleBlock);

struct TupleHeadImpl : HeadImpl {
  torch::Tensor forward(std::vector<torch::Tensor> v) { return HeadImpl::forward(v[0] + v[1]); }
};
TORCH_MODULE(TupleHead);

// A head whose projection is the embedding's table (tied), held by
// reference (used, not registered: the embedding owns it) or registered as
// its submodule as well. Cut into pipeline stages, a registered table is
// tied across them (--tied), and one held by reference is refused (Note
// [Parameters across stages]).
struct TiedHeadImpl : torch::nn::Module {
  TiedHeadImpl(torch::nn::Embedding table, bool registered) : tok(std::move(table)) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    if (registered) register_module("tok", tok);
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(ln->forward(x), tok->weight); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Embedding tok;
};
TORCH_MODULE(TiedHead);

torch::nn::Sequential make_tied_model(bool registered) {
  torch::manual_seed(7);
  torch::nn::Sequential s;
  Embed embed(sequence::Attention{nullptr});  // plain attention (Embed(nullptr) would be an empty holder)
  s->push_back(embed);
  s->push_back(Block(sequence::Attention{nullptr}));
  s->push_back(Block(sequence::Attention{nullptr}));
  s->push_back(TiedHead(embed->tok, registered));
  return s;
}

torch::nn::Sequential make_model(const sequence::Attention& a, bool tuple = false) {
  torch::manual_seed(7);
  torch::nn::Sequential s;
  if (tuple) {
    s->push_back(TupleEmbed(a));
    s->push_back(TupleBlock(a));
    s->push_back(TupleBlock(a));
    s->push_back(TupleHead());
    return s;
  }
  s->push_back(Embed(a));
  s->push_back(Block(a));
  s->push_back(Block(a));
  s->push_back(Head());
  return s;
}

torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
}

std::pair<torch::Tensor, torch::Tensor> batch(int step, int replica, int64_t size) {
  torch::manual_seed(100 + step * 17 + replica);
  const torch::Tensor x = torch::randint(0, kVocab, {size, kContext});
  const torch::Tensor y = torch::randint(0, kVocab, {size, kContext});
  return {x, y};
}

// The module plan in the config file's words; Megatron's sequence
// parallelism adds "sequence=1" (activations [batch, time, dim]) and shards
// the norms and the position embedding.
std::string layers_json(bool seq, bool tied) {
  const std::string s = seq ? "sequence=1" : "";
  const auto with = [&](const std::string& kind, const std::string& opts) {
    std::string all = opts;
    if (!s.empty()) all += all.empty() ? s : ", " + s;
    return all.empty() ? kind : kind + "(" + all + ")";
  };
  // A tied head projects through the vocabulary-split table, its logits gathered whole.
  std::string j = fmt::format(R"j([["*.qkv", "{}"], ["*.proj", "{}"], ["*.up", "{}"], ["*.down", "{}"],
      ["0.tok", "{}"])j",
                              with("columnwise", "fused=3"), with("rowwise", ""), with("columnwise", ""),
                              with("rowwise", ""), tied ? with("vocab_embedding", "") : with("vocab_embedding", "untied"));
  if (!tied) j += fmt::format(R"j(, ["3.out", "{}"])j", with("columnwise", "gather"));
  if (seq) j += R"j(, ["*.ln1", "sequence_shard"], ["*.ln2", "sequence_shard"], ["3.ln", "sequence_shard"], ["0.pos", "sequence_shard(dim=0)"])j";
  return j + "]";
}

struct Args {
  int dp = 1, pp = 1, tp = 1, sp = 1, zero = 0, microbatches = 0, steps = 10, depth = 1, batch = 4;
  std::string schedule = "1f1b", sp_mode = "ring-attention", tp_mode = "1d";
  bool sequence_parallel = false, tuple = false;
  bool tied = false;  // the head's projection is the embedding's table, registered in both (pipeline: tied across stages)
  double host_fraction = 0.0;  // 0: everything resident; else host budget = fraction x model state
  std::string refuse;          // a Trainer refusal to provoke (refusals())
};

// --refuse CASE: the trainer must refuse, on every rank alike, before any
// collective of its own: no-attention (sp 2, a model without the plan's
// attention), no-layers (tp 2 without a module plan), grid (tp 4 in mode 2d
// with a module plan that leaves the linear layers out),
// zero (engine options asking for another ZeRO stage than the plan's),
// tied-mid-accumulation (a table tied across stages, saved after the first
// of two accumulation micro-steps: each copy's gradient is still its own
// stage's), tied-across-stages (the last layer using the first's table by reference,
// without registering it: found on the last stage's rank after the first
// step's passes, and refused there and on every other rank alike).
int refusals(const Args& a) {
  const Rendezvous r = Rendezvous::from_env();
  std::shared_ptr<Communicator> world = make_gloo_communicator(r);
  HybridPlan plan;
  std::string want;
  EngineOptions o;
  o.budgets = {1 << 24, 1 << 24, 0};
  if (a.refuse == "no-attention") {
    plan.sp.size = r.world_size;
    want = "the model has no sequence-parallel attention";
  } else if (a.refuse == "no-layers") {
    plan.tp.size = r.world_size;
    want = "needs the plan's tensor layers";
  } else if (a.refuse == "grid") {
    plan.tp.size = r.world_size;
    plan.tp.mode = TensorMode::k2D;
    plan.tp.layers = {{"0.tok", ParallelStyle::vocab_embedding()}};
    want = "is a linear layer the plan does not name: in tensor mode 2d every activation is split";
  } else if (a.refuse == "zero") {
    plan.dp = r.world_size;
    plan.zero_stage = 1;
    o.zero_stage = 3;
    want = "the plan's zero_stage decides";
  } else if (a.refuse == "tied-mid-accumulation") {
    plan.pp.size = r.world_size;
    o.grad_accumulation = 2;
    want = "save on an accumulation boundary";
  } else if (a.refuse == "tied-across-stages") {
    plan.pp.size = r.world_size;
    want = "which another stage owns (it got a gradient on that rank)";
  } else {
    STRATA_FAIL("unknown --refuse case ", a.refuse, "; choose no-attention, no-layers, grid, zero, "
                "tied-mid-accumulation or tied-across-stages");
  }
  plan = plan.validated(r.world_size);
  DeviceMesh mesh = DeviceMesh::create(world, plan.dims());
  const bool tied = a.refuse == "tied-across-stages" || a.refuse == "tied-mid-accumulation";
  torch::nn::Sequential model = tied ? make_tied_model(/*registered=*/a.refuse == "tied-mid-accumulation")
                                     : make_model(nullptr);
  std::string got = "no error";
  const double tag = all_gather_values(*world, {static_cast<double>(::getpid())})[0];
  const std::string dir = fmt::format("/tmp/strata-hybrid-refuse-{:.0f}", tag);
  try {
    Trainer trainer(model, mesh, plan, OptimizerConfig::from(AdamWConfig{}), o);
    if (tied) {
      const auto [x, y] = batch(0, 0, a.batch);
      trainer.step(x, y, loss_of);
    }
    if (a.refuse == "tied-mid-accumulation") trainer.save(dir);
  } catch (const strata::Error& e) {
    got = e.what();
  }
  STRATA_CHECK(got.find(want) != std::string::npos, "--refuse ", a.refuse, ": expected an error saying \"", want,
               "\", got: ", got);
  STRATA_CHECK(!std::filesystem::exists(dir), "--refuse ", a.refuse, ": the refused save left ", dir, " behind");
  std::printf("rank %d: refused (%s): %s\n", r.rank, a.refuse.c_str(), got.c_str());
  std::fflush(stdout);
  // Rank 0 serves the store: no rank leaves while another still forms its
  // groups (after the refused step, too: every rank refused it).
  world->barrier()->wait();
  return 0;
}

// This rank's part of the reference's parameter `name` under the plan's style for it.
torch::Tensor local_part(const std::string& name, const torch::Tensor& full, const HybridPlan& plan, int r) {
  const int t = plan.tp.size;
  if (t == 1) return full;
  const auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  const bool bias = ends(".bias");
  const auto rows = [&](const torch::Tensor& w, int fused) {
    const int64_t n = w.size(0) / fused / t;
    std::vector<torch::Tensor> blocks;
    for (int f = 0; f < fused; ++f) blocks.push_back(w.narrow(0, f * n * t + r * n, n));
    return torch::cat(blocks, 0);
  };
  if (name.find(".qkv.") != std::string::npos) return rows(full, 3);
  if (name.find(".up.") != std::string::npos) return rows(full, 1);
  // A gathered output keeps its bias whole (parallelize's keep_shape).
  if (name.find(".out.") != std::string::npos) return bias ? full : rows(full, 1);
  if (name.find(".tok.") != std::string::npos) return rows(full, 1);
  if (name.find(".proj.") != std::string::npos || name.find(".down.") != std::string::npos) {
    return bias ? full : full.narrow(1, full.size(1) / t * r, full.size(1) / t);
  }
  return full;
}

// Rows of block `index` of `parts` of each of `fused` equal blocks along dimension 0, concatenated.
torch::Tensor fused_block(const torch::Tensor& w, int fused, int index, int parts) {
  const int64_t each = w.size(0) / fused, n = each / parts;
  std::vector<torch::Tensor> rows;
  for (int f = 0; f < fused; ++f) rows.push_back(w.narrow(0, f * each + index * n, n));
  return torch::cat(rows, 0);
}

// This rank's part of the reference's parameter `name` in a grid mode, as
// the 2D/2.5D layers (rank = (depth * q + row) * q + col) and the 3D ones
// (rank = (i * d + j) * d + k; columnwise layers from side A, rowwise from B)
// keep it: written out here from the layouts in tensor_parallel_2d.h and _3d.h.
torch::Tensor grid_part(const std::string& name, const torch::Tensor& full, const HybridPlan& plan, int r) {
  const auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  const bool bias = has(".bias");
  const int fused = has(".qkv.") ? 3 : 1;
  const bool columnwise = has(".qkv.") || has(".up.") || has(".out.");
  const bool linear = columnwise || has(".proj.") || has(".down.");
  if (has(".out.") && bias) return full;  // a gathered output's bias stays whole
  if (plan.tp.mode != TensorMode::k3D) {
    const int q = static_cast<int>(std::lround(std::sqrt(plan.tp.size / plan.tp.depth)));
    const int col = r % q, row = (r / q) % q;
    if (linear && !bias) {
      const int64_t in = full.size(1) / q;
      return fused_block(full, fused, col, q).narrow(1, row * in, in);
    }
    if (has(".tok.")) return full.narrow(0, row * kVocab / q, kVocab / q).narrow(1, col * kDim / q, kDim / q);
    if (has(".pos.")) return full.narrow(1, (col * q + row) * kDim / (q * q), kDim / (q * q));
    return fused_block(full, fused, col, q);  // biases and norms: feature block col
  }
  const int d = static_cast<int>(std::lround(std::cbrt(plan.tp.size)));
  const int k = r % d, j = (r / d) % d, i = r / (d * d);
  const int feature = columnwise ? k : j, piece = columnwise ? j : k;  // the input side's axes
  if (linear) {
    const torch::Tensor out_block = fused_block(full, fused, piece, d);
    if (bias) return out_block;
    const int64_t rows = out_block.size(0) / d, in = full.size(1) / d;
    return out_block.narrow(0, i * rows, rows).narrow(1, feature * in, in);
  }
  if (has(".tok.") || has(".pos.")) {
    const int64_t block = kDim / d, part = block / (d * d);
    return full.narrow(1, k * block + (i * d + j) * part, part);  // side A: feature block k, piece i * d + j
  }
  return full.narrow(0, k * kDim / d, kDim / d);  // norms on side A
}

std::string nvme_dir() { return fmt::format("/tmp/strata-hybrid-check-{}", ::getpid()); }

// --tied: the model trained under the plan, saved, loads into one process
// (no pipeline, no data or tensor parallelism): the table is in the
// checkpoint once, and every parameter equals the reference's.
void check_tied_checkpoint(Trainer& trainer, const DeviceMesh& mesh, torch::nn::Sequential& reference,
                           const std::string& label) {
  Communicator& world = *mesh.world();
  const double tag = all_gather_values(world, {static_cast<double>(::getpid())})[0];
  const std::string dir = fmt::format("/tmp/strata-hybrid-tied-{:.0f}", tag);
  trainer.save(dir);
  // The table once: its pieces from the first stage's parts alone (parts are numbered pipeline rank x tp + tensor rank).
  std::ifstream state_file(dir + "/state.json");
  const nlohmann::json state = nlohmann::json::parse(state_file);
  int pieces = 0;
  for (const nlohmann::json& p : state.at("parameters")) {
    if (p.at("name") != "0.tok.weight") continue;
    for (const nlohmann::json& piece : p.at("pieces")) {
      STRATA_CHECK(piece.at("part").get<int>() < trainer.plan().tp.size, label, ": the tied table is saved from "
                   "part ", piece.at("part").get<int>(), ", not the first stage's");
      ++pieces;
    }
  }
  STRATA_CHECK(pieces == trainer.plan().tp.size, label, ": the checkpoint holds ", pieces, " pieces of the tied table, "
               "expected one per tensor rank");
  torch::nn::Sequential one = make_tied_model(true);
  EngineOptions o;
  o.budgets = {1 << 24, 1 << 24, 0};
  std::unique_ptr<Engine> engine = attach(*one, OptimizerConfig::from(AdamWConfig{}), o);
  engine->load(dir);
  auto want = reference->named_parameters();
  for (const auto& item : one->named_parameters()) {
    const torch::Tensor expect = want[item.key()].detach();
    const double diff = ((item.value().detach().to(torch::kCPU) - expect).norm() / expect.norm()).item<double>();
    STRATA_CHECK(diff <= 1e-5, label, ": parameter ", item.key(), " loaded into one process from the checkpoint "
                 "differs from one process's by ", diff);
  }
  world.barrier()->wait();  // every rank has read it
  if (mesh.rank() == 0) std::filesystem::remove_all(dir);
  std::printf("rank %d: %s: its checkpoint loads into one process, equal\n", mesh.rank(), label.c_str());
}

int run(const Args& a) {
  const Rendezvous r = Rendezvous::from_env();
  const std::string json = fmt::format(
      R"j({{"dp": {}, "zero_stage": {}, "pipeline": {{"size": {}, "schedule": "{}", "microbatches": {}}},
          "tensor": {{"size": {}, "mode": "{}", "depth": {}, "sequence_parallel": {}{}}},
          "sequence": {{"size": {}, "mode": "{}"}}}})j",
      a.dp, a.zero, a.pp, a.schedule, a.microbatches, a.tp, a.tp_mode, a.depth, a.sequence_parallel ? "true" : "false",
      // The module plan describes the model, whatever the layout: at tp 1 it is not used.
      ", \"layers\": " + layers_json(a.sequence_parallel, a.tied), a.sp, a.sp_mode);
  ModelShape shape;
  shape.hidden = kDim;
  shape.heads = kHeads;
  shape.context = kContext;
  shape.layers = 4;
  const HybridPlan plan = HybridPlan::from_json(json, "hybrid_check's plan").validated(r.world_size, shape);
  DeviceMesh mesh = DeviceMesh::create(make_gloo_communicator(r), plan.dims());
  const std::string label = plan.describe() + (a.host_fraction > 0 ? ", offload" : "") +
                            (a.tuple ? ", tuples between layers" : "") + (a.tied ? ", tied head" : "");
  STRATA_CHECK(!a.tuple || (plan.sp.size == 1 && !plan.tp.sequence_parallel), "--tuple: the layers' mask is for "
               "whole sequences; drop --sp and --sequence-parallel");
  STRATA_CHECK(!a.tied || (plan.sp.size == 1 && !plan.tp.sequence_parallel && !a.tuple &&
                           plan.tp.mode == TensorMode::k1D),
               "--tied: the tied model has plain attention and whole sequences in 1D; drop --sp, "
               "--sequence-parallel, --tuple and --tp-mode");

  torch::nn::Sequential reference = a.tied ? make_tied_model(true) : make_model(nullptr, a.tuple);
  torch::nn::Sequential model = a.tied ? make_tied_model(true) : make_model(sequence_attention(mesh, plan), a.tuple);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  EngineOptions o;
  o.clip_norm = 1.0;
  const std::string nvme = nvme_dir();
  if (a.host_fraction > 0) {
    // Budgets from this rank's share of the state (16 bytes per parameter):
    // device a quarter, host the fraction asked (at least five 4 KiB chunks:
    // one family's parameters, gradients and optimizer state, and one
    // arriving), NVMe the rest and more.
    const double share = static_cast<double>(params) * 16 / (plan.pp.size * plan.tp.size);
    o.budgets = {static_cast<uint64_t>(share / 4) / 4096 * 4096 + 16384,
                 std::max<uint64_t>(static_cast<uint64_t>(share * a.host_fraction) + 8192, 5 * 4096),
                 static_cast<uint64_t>(share * 4) + (1 << 20)};
    o.nvme_dir = nvme;
  } else {
    o.budgets = {static_cast<uint64_t>(params) * 64 + (1 << 20), static_cast<uint64_t>(params) * 64 + (1 << 20), 0};
  }
  AdamWConfig cfg;
  cfg.lr = 1e-2f;
  // --tied: the table in an optimizer group of its own (twice the lr, no
  // weight decay), selected by the name one process gives it (its first):
  // every stage's copy must be in it.
  OptimizerConfig optimizer = OptimizerConfig::from(cfg);
  if (a.tied) {
    ParamGroup table = group_by_names("table", {"0.tok.weight"});
    table.lr = 2 * cfg.lr;
    table.weight_decay = 0.0;
    optimizer.groups.push_back(table);
  }
  Trainer trainer(model, mesh, plan, optimizer, o, shape);
  // Each parameter once: LibTorch's parameters() lists a tied table under both its names.
  const torch::Tensor table = reference->named_parameters()["0.tok.weight"];
  std::vector<torch::Tensor> ref_params, ref_rest;
  for (const torch::Tensor& p : reference->parameters()) {
    const bool seen = std::any_of(ref_params.begin(), ref_params.end(), [&](const torch::Tensor& q) { return q.is_same(p); });
    if (seen) continue;
    ref_params.push_back(p);
    if (!a.tied || !p.is_same(table)) ref_rest.push_back(p);
  }
  std::vector<torch::optim::OptimizerParamGroup> ref_groups;
  if (a.tied) {
    ref_groups.emplace_back(std::vector<torch::Tensor>{table},
                            std::make_unique<torch::optim::AdamWOptions>(
                                torch::optim::AdamWOptions(2 * cfg.lr).weight_decay(0.0)));
  }
  ref_groups.emplace_back(ref_rest);
  torch::optim::AdamW adamw(ref_groups, torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay));

  const int replica = mesh.coord(DeviceMesh::kData);
  for (int s = 0; s < a.steps; ++s) {
    adamw.zero_grad();
    torch::Tensor total = torch::zeros({});
    double mine = 0.0;
    for (int d = 0; d < plan.dp; ++d) {
      const auto [x, y] = batch(s, d, a.batch);
      const torch::Tensor l = loss_of(reference->forward(x), y);
      if (d == replica) mine = l.item<double>();
      total = total + l / plan.dp;
    }
    total.backward();
    torch::nn::utils::clip_grad_norm_(ref_params, o.clip_norm);
    adamw.step();
    const auto [x, y] = batch(s, replica, a.batch);
    const StepResult got = trainer.step(x, y, loss_of);
    STRATA_CHECK(got.stepped, label, ": step ", s, " was skipped");
    STRATA_CHECK(std::fabs(got.loss - mine) <= 1e-5 * std::max(1.0, std::fabs(mine)), label, ": step ", s, " loss ",
                 got.loss, ", one process's ", mine);
  }
  // Every parameter this rank holds against its part of the reference's.
  auto want = reference->named_parameters();
  double worst = 0.0;
  int compared = 0;
  for (const auto& item : trainer.module().named_parameters()) {
    std::string name = item.key();
    if (plan.pp.size > 1) name = name.substr(name.find('.') + 1);  // "stage<s>.<layer>.<rest>"
    const torch::Tensor expect = plan.tp.mode == TensorMode::k1D
                                     ? local_part(name, want[name].detach(), plan, mesh.coord(DeviceMesh::kTensor))
                                     : grid_part(name, want[name].detach(), plan, mesh.coord(DeviceMesh::kTensor));
    const torch::Tensor got = item.value().detach().to(torch::kCPU);
    STRATA_CHECK(got.sizes() == expect.sizes(), label, ": parameter ", name, " has shape ", got.sizes(),
                 ", its part of the reference ", expect.sizes());
    const double diff = ((got - expect).norm() / expect.norm().clamp_min(1e-12)).item<double>();
    worst = std::max(worst, diff);
    STRATA_CHECK(diff <= 1e-5, label, ": parameter ", name, " differs from one process's by ", diff, " (relative L2)");
    ++compared;
  }
  STRATA_CHECK(compared > 0, label, ": this rank holds no parameter to compare");
  // Evaluation on a fixed batch: the whole trained model at once.
  const auto [ex, ey] = batch(99, 0, a.batch);
  const torch::Tensor out = trainer.evaluate(ex);
  const bool last = mesh.coord(DeviceMesh::kPipeline) == plan.pp.size - 1;
  if (last) {
    torch::NoGradGuard no_grad;
    const torch::Tensor ref = trainer.shard(reference->forward(ex));
    STRATA_CHECK(out.defined() && out.sizes() == ref.sizes(), label, ": evaluation output shape ",
                 out.defined() ? out.sizes() : torch::IntArrayRef{}, ", one process's ", ref.sizes());
    const double diff = ((out.to(torch::kCPU) - ref).norm() / ref.norm()).item<double>();
    STRATA_CHECK(diff <= 1e-5, label, ": evaluation output differs from one process's by ", diff);
  } else {
    STRATA_CHECK(!out.defined(), label, ": a rank before the last stage got an evaluation output");
  }
  if (a.tied) check_tied_checkpoint(trainer, mesh, reference, label);
  const RankReport rep = trainer.report();
  if (a.host_fraction > 0) {
    const auto& dev = rep.tiers[static_cast<int>(strata::memory::Tier::kDevice)];
    const auto& host = rep.tiers[static_cast<int>(strata::memory::Tier::kHost)];
    STRATA_CHECK(dev.peak <= dev.budget && host.peak <= host.budget, label, ": a tier exceeded its budget: ",
                 rep.describe());
  }
  std::printf("rank %d: %s matches one process: %d steps, %d parameters within %.1e, evaluation equal\n", mesh.rank(),
              label.c_str(), a.steps, compared, worst);
  std::printf("%s\n", rep.describe().c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&] {
      STRATA_CHECK(i + 1 < argc, arg, " needs a value");
      return std::string(argv[++i]);
    };
    if (arg == "--dp") a.dp = std::stoi(next());
    else if (arg == "--pp") a.pp = std::stoi(next());
    else if (arg == "--tp") a.tp = std::stoi(next());
    else if (arg == "--tp-mode") a.tp_mode = next();
    else if (arg == "--depth") a.depth = std::stoi(next());
    else if (arg == "--batch") a.batch = std::stoi(next());
    else if (arg == "--sp") a.sp = std::stoi(next());
    else if (arg == "--zero") a.zero = std::stoi(next());
    else if (arg == "--schedule") a.schedule = next();
    else if (arg == "--microbatches") a.microbatches = std::stoi(next());
    else if (arg == "--sp-mode") a.sp_mode = next();
    else if (arg == "--sequence-parallel") a.sequence_parallel = true;
    else if (arg == "--tuple") a.tuple = true;
    else if (arg == "--tied") a.tied = true;
    else if (arg == "--host-fraction") a.host_fraction = std::stod(next());
    else if (arg == "--steps") a.steps = std::stoi(next());
    else if (arg == "--refuse") a.refuse = next();
    else {
      std::fprintf(stderr, "hybrid_check: unknown option %s\n", arg.c_str());
      return 2;
    }
  }
  int status = 1;
  try {
    status = a.refuse.empty() ? run(a) : refusals(a);  // the trainer and its NVMe store are gone when it returns
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hybrid_check: %s\n", e.what());
  }
  std::filesystem::remove_all(nvme_dir());
  return status;
}
