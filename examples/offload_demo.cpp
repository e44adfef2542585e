// offload_demo: a LibTorch MLP stack whose weights live in strata chunks and
// run through a device tier far smaller than the model.
//
// Every parameter of an ordinary torch::nn::Sequential is registered with the
// ChunkManager and copied into its chunk. Each forward pass then walks the
// layers: the layer's chunks are made resident on the device tier (evicting
// others, device -> host -> nvme as the budgets demand), pinned in COMPUTE,
// used through zero-copy tensor views, and released to HOLD. The output is
// compared with the unmodified module's forward on the same input: it must be
// bit-identical, and no tier may exceed its budget. It shows the memory layer
// alone, below the engine: training through attach is examples/gpt.
//
//   offload_demo [--layers 8] [--hidden 512] [--device-budget 24MiB] [--host-budget 40MiB]
//                [--nvme-budget 256MiB] [--nvme-dir DIR] [--steps 3]
// Options can also come from STRATA_DEVICE_BUDGET, STRATA_HOST_BUDGET,
// STRATA_NVME_BUDGET and STRATA_NVME_DIR. With the defaults the model does not
// fit on device and host together, so every pass also streams chunks from NVMe.

#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>
#include <map>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/memory/chunk_manager.h"
#include "strata/memory/nvme_swap_store.h"

namespace mem = strata::memory;

namespace {

torch::nn::Sequential make_model(int layers, int hidden) {
  torch::nn::Sequential model;
  for (int i = 0; i < layers; ++i) {
    model->push_back(torch::nn::Linear(hidden, 4 * hidden));
    model->push_back(torch::nn::GELU());
    model->push_back(torch::nn::Linear(4 * hidden, hidden));
  }
  return model;
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

int run(int argc, char** argv) {
  int layers = 8, hidden = 512, steps = 3, batch = 16;
  std::string device_budget = env_or("STRATA_DEVICE_BUDGET", "24MiB");
  std::string host_budget = env_or("STRATA_HOST_BUDGET", "40MiB");
  std::string nvme_budget = env_or("STRATA_NVME_BUDGET", "256MiB");
  std::string nvme_dir = env_or("STRATA_NVME_DIR", "/tmp/strata-demo-nvme");
  CLI::App app{"strata offload demo: an MLP stack run through a device tier smaller than the model"};
  app.add_option("--layers", layers, "MLP blocks")->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden, "hidden width")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "forward passes")->check(CLI::PositiveNumber);
  app.add_option("--device-budget", device_budget, "device tier budget, e.g. 24MiB");
  app.add_option("--host-budget", host_budget, "host tier budget, e.g. 1GiB");
  app.add_option("--nvme-budget", nvme_budget, "nvme tier budget (0: no nvme tier)");
  app.add_option("--nvme-dir", nvme_dir, "directory of the nvme tier's files");
  CLI11_PARSE(app, argc, argv);

  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  torch::nn::Sequential model = make_model(layers, hidden);

  mem::ChunkManagerOptions opts;
  opts.budgets = mem::TierBudgets::from_strings(device_budget, host_budget, nvme_budget);
  if (opts.budgets.nvme > 0) {
    strata::offload::NvmeStoreOptions nvme;
    nvme.directory = nvme_dir;
    nvme.capacity = opts.budgets.nvme;
    opts.nvme = std::make_shared<mem::NvmeSwapStore>(nvme);
  }
  mem::ChunkManager mgr(std::move(opts));
  const bool on_gpu = mgr.device().kind() == strata::offload::DeviceKind::kCuda;
  const torch::Device compute_device = on_gpu ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);

  // Register every parameter, in module order, into fp32 families with Adam state.
  std::vector<mem::TensorSpec> specs;
  std::vector<torch::Tensor> params;
  int64_t total = 0;
  for (const auto& p : model->named_parameters()) {
    specs.push_back({p.key(), p.value().numel()});
    params.push_back(p.value());
    total += p.value().numel();
  }
  mem::FamilySpec family;
  family.optim_states = 2;
  // The manager caps the search at a quarter of the device budget.
  const mem::Registration reg = mgr.register_tensors(specs, family, mem::ChunkSizeSearch{1 << 16, 1 << 22, 1 << 14, 1});
  fmt::print("model: {} blocks of {}->{}->{}, {} parameters ({} fp32)\n", layers, hidden, 4 * hidden, hidden, total,
             strata::format_bytes(total * 4));
  fmt::print("chunks: size {} elements ({}), {} families, {} chunks in all (param, grad, adam m, v), padding {:.2f}%\n",
             reg.plan.chunk_elems, strata::format_bytes(reg.plan.chunk_elems * 4), reg.families.size(),
             mgr.num_chunks(), reg.plan.waste_percent());
  fmt::print("budgets: device {} ({}), host {}, nvme {}{}\n", device_budget, mgr.device().name(), host_budget,
             nvme_budget, mgr.tier_stats(mem::Tier::kNvme).budget > 0 ? " in " + nvme_dir : "");

  // Move the weights into their chunks (on host), then drop the originals' use.
  for (size_t i = 0; i < params.size(); ++i) {
    const mem::TensorPlacement& pl = reg.tensors[i];
    const mem::ChunkId c = mgr.family(pl.family).param;
    mgr.access(c, mem::Tier::kHost);
    // Copy only this tensor's slot: read-modify-write of the whole chunk would
    // be wasteful, so write through the host pointer directly.
    auto* base = static_cast<float*>(mgr.data(c));
    std::memcpy(base + pl.offset, params[i].data_ptr<float>(), pl.numel * sizeof(float));
    mgr.transition(c, pl.slot, mem::TensorState::kHold);
  }

  const torch::Tensor input = torch::randn({batch, hidden});
  const torch::Tensor reference = model->forward(input);

  // Which parameter indices each Linear uses, in order.
  std::vector<std::pair<size_t, size_t>> linear_params;  // (weight, bias)
  for (size_t i = 0; i + 1 < params.size(); i += 2) linear_params.emplace_back(i, i + 1);

  double max_diff = 0;
  for (int step = 0; step < steps; ++step) {
    const mem::MoveStats before = mgr.move_stats();
    torch::Tensor x = input.to(compute_device);
    for (size_t l = 0; l < linear_params.size(); ++l) {
      torch::Tensor wb[2];
      const size_t idx[2] = {linear_params[l].first, linear_params[l].second};
      // Make both chunks resident before pinning either, so the second access
      // may still evict the first's neighbours.
      for (size_t k : idx) mgr.access(mgr.family(reg.tensors[k].family).param, mem::Tier::kDevice);
      for (int k = 0; k < 2; ++k) {
        const mem::TensorPlacement& pl = reg.tensors[idx[k]];
        const mem::ChunkId c = mgr.family(pl.family).param;
        mgr.access(c, mem::Tier::kDevice);
        mgr.transition(c, pl.slot, mem::TensorState::kCompute);
        auto* base = static_cast<float*>(mgr.data(c));
        wb[k] = torch::from_blob(base + pl.offset, params[idx[k]].sizes(),
                                 torch::TensorOptions().dtype(torch::kFloat32).device(compute_device));
      }
      x = torch::nn::functional::linear(x, wb[0], wb[1]);
      if (l % 2 == 0) x = torch::gelu(x);
      for (size_t k : idx) {
        const mem::TensorPlacement& pl = reg.tensors[k];
        mgr.transition(mgr.family(pl.family).param, pl.slot, mem::TensorState::kHold);
      }
    }
    max_diff = std::max(max_diff, (x.cpu() - reference).abs().max().item<double>());
    const mem::MoveStats after = mgr.move_stats();
    const int d = static_cast<int>(mem::Tier::kDevice), h = static_cast<int>(mem::Tier::kHost);
    const int n = static_cast<int>(mem::Tier::kNvme);
    fmt::print("step {}: host->device {}, nvme->device {}, device->host {}, host->nvme {}, max |strata - torch| = {}\n",
               step, strata::format_bytes(after.bytes[h][d] - before.bytes[h][d]),
               strata::format_bytes(after.bytes[n][d] - before.bytes[n][d]),
               strata::format_bytes(after.bytes[d][h] - before.bytes[d][h]),
               strata::format_bytes(after.bytes[h][n] - before.bytes[h][n]), max_diff);
  }

  bool ok = max_diff == 0.0;
  for (mem::Tier t : {mem::Tier::kDevice, mem::Tier::kHost, mem::Tier::kNvme}) {
    const mem::TierStats s = mgr.tier_stats(t);
    fmt::print("{:<7} peak {} of budget {} ({} evictions)\n", mem::tier_name(t), strata::format_bytes(s.peak),
               strata::format_bytes(s.budget), s.evictions);
    ok = ok && s.peak <= s.budget;
  }
  fmt::print("{}: model of {} ran through a {} device tier ({} host, {} nvme), output {}\n", ok ? "OK" : "FAILED",
             strata::format_bytes(total * 4), device_budget, host_budget, nvme_budget,
             max_diff == 0.0 ? "bit-identical to plain LibTorch" : "DIFFERENT from plain LibTorch");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const strata::Error& e) {
    std::fprintf(stderr, "offload_demo: error: %s\n", e.message().c_str());
    return 1;
  }
}
