// gpt: a decoder-only transformer, written with plain LibTorch modules, trained
// on real text by strata with model state several times larger than the
// device budget (emulated device here, a GPU where there is one).
//
//   gpt [--data FILE] [--steps 120] [--layers 4] [--dim 128] [--context 64] [--batch 16]
//       [--device-budget B] [--host-budget B] [--nvme-budget B] [--nvme-dir DIR] [--lr 3e-3]
//
// The default corpus is Debian's fortunes-min package (/usr/share/games/fortunes),
// read as bytes. Budgets default to 1/4 (device), 1/2 (host) and 2x (nvme) of
// the model state (parameters, gradients, AdamW state), so state streams
// through all three tiers. STRATA_DEVICE_BUDGET, STRATA_HOST_BUDGET,
// STRATA_NVME_BUDGET and STRATA_NVME_DIR set them from the environment.

#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <sstream>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/parallel/engine.h"

namespace {

namespace mem = strata::memory;

struct Block : torch::nn::Module {
  int heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr};
  Block(int dim, int heads_) : heads(heads_) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
    proj = register_module("proj", torch::nn::Linear(dim, dim));
    up = register_module("up", torch::nn::Linear(dim, 4 * dim));
    down = register_module("down", torch::nn::Linear(4 * dim, dim));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads;
    auto parts = qkv->forward(ln1->forward(x)).chunk(3, -1);
    auto split = [&](const torch::Tensor& y) { return y.view({b, t, heads, hd}).transpose(1, 2); };
    torch::Tensor q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
    torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    att = torch::softmax(att.masked_fill(mask, -1e9), -1);
    x = x + proj->forward(torch::matmul(att, v).transpose(1, 2).contiguous().view({b, t, d}));
    return x + down->forward(torch::gelu(up->forward(ln2->forward(x))));
  }
};

struct Gpt : torch::nn::Module {
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln{nullptr};
  Gpt(int vocab, int context, int dim, int layers, int heads) {
    tok = register_module("tok", torch::nn::Embedding(vocab, dim));
    pos = register_module("pos", torch::nn::Embedding(context, dim));
    for (int i = 0; i < layers; ++i) blocks->push_back(std::make_shared<Block>(dim, heads));
    register_module("blocks", blocks);
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      if (p.key().find("ln") != std::string::npos) continue;  // LayerNorm keeps ones and zeros
      if (p.value().dim() >= 2) {
        p.value().normal_(0.0, 0.02);
      } else {
        p.value().zero_();
      }
    }
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    const int64_t t = idx.size(1);
    const torch::Tensor mask = torch::ones({t, t}, torch::kBool).triu(1);
    torch::Tensor x = tok->forward(idx) + pos->forward(torch::arange(t));
    for (const auto& m : *blocks) x = m->as<Block>()->forward(x, mask);
    return torch::nn::functional::linear(ln->forward(x), tok->weight);  // output tied to the input embedding
  }
};

std::string read_corpus(const std::string& path) {
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
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      if (e.is_regular_file() && e.path().extension() != ".dat") slurp(e.path());
    }
  }
  STRATA_CHECK(text.size() > 1024, "the corpus has only ", text.size(), " bytes; give a larger --data file");
  return text;
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

int run(int argc, char** argv) {
  int steps = 120, layers = 4, dim = 128, context = 64, batch = 16, heads = 4;
  float lr = 3e-3f;
  std::string data, device_budget = env_or("STRATA_DEVICE_BUDGET", "auto"),
                    host_budget = env_or("STRATA_HOST_BUDGET", "auto"),
                    nvme_budget = env_or("STRATA_NVME_BUDGET", "auto"),
                    nvme_dir = env_or("STRATA_NVME_DIR", "/tmp/strata-gpt-nvme");
  CLI::App app{"Train a small GPT on text with strata"};
  app.add_option("--data", data, "text file (default: Debian's fortunes-min corpus)");
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  app.add_option("--layers", layers)->check(CLI::PositiveNumber);
  app.add_option("--dim", dim)->check(CLI::PositiveNumber);
  app.add_option("--context", context)->check(CLI::PositiveNumber);
  app.add_option("--batch", batch)->check(CLI::PositiveNumber);
  app.add_option("--lr", lr);
  app.add_option("--device-budget", device_budget, "auto: a quarter of the model state");
  app.add_option("--host-budget", host_budget, "auto: half of the model state");
  app.add_option("--nvme-budget", nvme_budget, "auto: twice the model state; 0: no nvme tier");
  app.add_option("--nvme-dir", nvme_dir);
  bool baseline = false;
  app.add_flag("--baseline", baseline, "train with plain LibTorch and torch::optim::AdamW instead (for comparison)");
  CLI11_PARSE(app, argc, argv);
  STRATA_CHECK(dim % heads == 0, "--dim must be a multiple of ", heads);

  const std::string text = read_corpus(data);
  const torch::Tensor corpus =
      torch::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, torch::kUInt8)
          .to(torch::kLong);
  torch::manual_seed(0);
  Gpt model(256, context, dim, layers, heads);
  int64_t params = 0;
  for (const auto& p : model.parameters()) params += p.numel();
  const uint64_t state = static_cast<uint64_t>(params) * 16;  // fp32 param, grad, exp_avg, exp_avg_sq
  auto budget = [&](const std::string& s, double fraction) {
    return s == "auto" ? strata::round_up(static_cast<uint64_t>(state * fraction), 4096) : strata::parse_bytes(s);
  };
  strata::parallel::EngineOptions opts;
  opts.budgets = {budget(device_budget, 0.25), budget(host_budget, 0.5), budget(nvme_budget, 2.0)};
  opts.nvme_dir = nvme_dir;
  opts.clip_norm = 1.0;
  strata::parallel::AdamWConfig cfg;
  cfg.lr = lr;
  if (baseline) {
    // Plain LibTorch, everything resident: the reference point for strata's figures.
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(lr).weight_decay(cfg.weight_decay));
    const auto t0 = std::chrono::steady_clock::now();
    double loss = 0;
    for (int step = 1; step <= steps; ++step) {
      const torch::Tensor starts = torch::randint(0, corpus.size(0) - context - 1, {batch});
      std::vector<torch::Tensor> xs, ys;
      for (int b = 0; b < batch; ++b) {
        const int64_t s0 = starts[b].item<int64_t>();
        xs.push_back(corpus.slice(0, s0, s0 + context));
        ys.push_back(corpus.slice(0, s0 + 1, s0 + context + 1));
      }
      opt.zero_grad();
      torch::Tensor l = torch::cross_entropy_loss(model.forward(torch::stack(xs)).view({-1, 256}), torch::stack(ys).view({-1}));
      l.backward();
      torch::nn::utils::clip_grad_norm_(model.parameters(), 1.0);
      opt.step();
      loss = l.item<double>();
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("plain LibTorch: {} steps, last loss {:.3f}, {:.0f} tok/s\n", steps, loss, steps * batch * context / secs);
    return 0;
  }
  auto engine = strata::parallel::attach(model, cfg, opts);
  fmt::print("corpus: {} bytes; model: {} layers, dim {}, context {}, {} parameters\n", text.size(), layers, dim,
             context, params);
  fmt::print("model state {} (params, grads, AdamW m and v) on budgets: device {} ({:.1f}x smaller, {}), host {}, "
             "nvme {} in {}\n",
             strata::format_bytes(state), strata::format_bytes(opts.budgets.device),
             static_cast<double>(state) / opts.budgets.device, engine->chunks().device().name(),
             strata::format_bytes(opts.budgets.host), strata::format_bytes(opts.budgets.nvme), nvme_dir);

  const bool tty = isatty(STDOUT_FILENO);
  const auto start = std::chrono::steady_clock::now();
  double first_loss = 0, avg = 0;
  const int64_t n = corpus.size(0) - context - 1;
  for (int step = 1; step <= steps; ++step) {
    const torch::Tensor starts = torch::randint(0, n, {batch});
    std::vector<torch::Tensor> xs, ys;
    for (int b = 0; b < batch; ++b) {
      const int64_t s = starts[b].item<int64_t>();
      xs.push_back(corpus.slice(0, s, s + context));
      ys.push_back(corpus.slice(0, s + 1, s + context + 1));
    }
    const torch::Tensor x = torch::stack(xs), y = torch::stack(ys);
    const auto r = engine->train_step([&] {
      return torch::cross_entropy_loss(model.forward(x).view({-1, 256}), y.view({-1}));
    });
    if (step == 1) first_loss = avg = r.loss;
    avg = 0.95 * avg + 0.05 * r.loss;
    if (tty || step % 25 == 0 || step == steps) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const mem::MoveStats m = engine->chunks().move_stats();
      auto moved = [&](mem::Tier a, mem::Tier b) { return strata::format_bytes(m.bytes[int(a)][int(b)]); };
      const int width = 24, done = width * step / steps;
      fmt::print("{}[{}{}] step {}/{} loss {:.3f} tok/s {:.0f} | h>d {} d>h {} h>n {} n>h {} n>d {}{}", tty ? "\r" : "",
                 std::string(done, '#'), std::string(width - done, '.'), step, steps, avg,
                 step * batch * context / secs, moved(mem::Tier::kHost, mem::Tier::kDevice),
                 moved(mem::Tier::kDevice, mem::Tier::kHost), moved(mem::Tier::kHost, mem::Tier::kNvme),
                 moved(mem::Tier::kNvme, mem::Tier::kHost), moved(mem::Tier::kNvme, mem::Tier::kDevice),
                 tty ? "   " : "\n");
      std::fflush(stdout);
    }
  }
  if (tty) fmt::print("\n");
  for (mem::Tier t : {mem::Tier::kDevice, mem::Tier::kHost, mem::Tier::kNvme}) {
    const mem::TierStats s = engine->chunks().tier_stats(t);
    fmt::print("{:<7} peak {} of budget {}\n", mem::tier_name(t), strata::format_bytes(s.peak),
               strata::format_bytes(s.budget));
  }
  fmt::print("loss {:.3f} -> {:.3f} over {} steps\n", first_loss, avg, steps);
  // Sample a line from the trained model.
  torch::Tensor idx = corpus.slice(0, 0, 8).unsqueeze(0);
  for (int i = 0; i < 80; ++i) {
    const torch::Tensor ctx = idx.slice(1, std::max<int64_t>(0, idx.size(1) - context));
    const torch::Tensor logits = engine->run([&] { return model.forward(ctx).select(1, -1); });
    idx = torch::cat({idx, torch::multinomial(torch::softmax(logits, -1), 1)}, 1);
  }
  std::string sample;
  for (int64_t i = 0; i < idx.size(1); ++i) sample += static_cast<char>(idx[0][i].item<int64_t>());
  fmt::print("sample: {}\n", sample);
  return avg < first_loss ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt: error: %s\n", e.what());
    return 1;
  }
}
