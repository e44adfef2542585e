// `strata bench checkpoint`: Engine::save and Engine::load of examples/gpt's
// model with its default placement (device a quarter of the model state, host
// half, the rest of the optimizer state on NVMe) and with all state fitting
// on host, in GB/s of checkpoint written or read, beside the NVMe store's raw
// write and read throughput over as many bytes in the same directory,
// measured in the same run; and `strata checkpoint export --hf` and
// `convert --to-layout single` of the checkpoint, in GB/s of tensors
// written. Loads, exports and conversions read from the disk: the page cache
// is told to drop the files first.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "bench_timing.h"
#include "commands.h"
#include "gpt_model.h"
#include "strata/checkpoint/checkpoint_dir.h"
#include "strata/checkpoint/convert.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/parallel/engine.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;

struct CheckpointBenchOptions {
  std::string size = "384x6";
  std::string precision = "fp32";
  std::string dir;
  int repeats = 3;
  bool json = false;
};

// Asks the kernel to drop the checkpoint's pages, so a load reads the disk.
void drop_cache(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

struct Measured {
  std::string placement;
  double save_s = 0, load_s = 0;
  uint64_t bytes = 0;
  size_t files = 0, nvme_families = 0, families = 0;
};

// Saves and loads examples/gpt's model `repeats` times under `eo`.
Measured measure_checkpoint(const examples::GptConfig& mc, const parallel::EngineOptions& eo, const std::string& ckpt,
                 int repeats) {
  torch::manual_seed(0);
  torch::nn::Sequential model = examples::gpt_layers(mc);
  Measured m;
  auto engine = parallel::attach(*model, parallel::AdamWConfig{}, eo);
  m.nvme_families = engine->nvme_optim_families();
  m.families = engine->num_families();
  for (int i = 0; i < 2; ++i) {  // optimizer state exists, and moved where it lives
    const torch::Tensor x = torch::randint(0, mc.vocab, {4, mc.context}), y = torch::randint(0, mc.vocab, {4, mc.context});
    engine->train_step([&] { return examples::gpt_loss(model->forward(x), y); });
  }
  std::vector<double> saves, loads;
  for (int r = 0; r < repeats; ++r) {
    saves.push_back(seconds([&] { engine->save(ckpt); }));
    drop_cache(ckpt);
    loads.push_back(seconds([&] { engine->load(ckpt); }));
  }
  m.save_s = median(saves);
  m.load_s = median(loads);
  const checkpoint::CheckpointReader r(ckpt);
  for (const auto& f : r.manifest().files) m.bytes += f.bytes;
  m.files = r.manifest().files.size() + 1;
  return m;
}

void run_checkpoint_bench(const CheckpointBenchOptions& o) {
  STRATA_CHECK(o.repeats >= 1, "--repeats must be at least 1");
  examples::GptConfig mc = examples::parse_gpt_size(o.size, 64);
  mc.tied_head = true;  // examples/gpt's default model (one stage)
  const DType precision = parse_dtype(o.precision);
  int64_t params = 0;
  {
    torch::manual_seed(0);
    torch::nn::Sequential model = examples::gpt_layers(mc);
    params = examples::count_parameters(*model);
  }
  const uint64_t state = static_cast<uint64_t>(params) * parallel::model_state_bytes_per_param(precision);
  const std::string ckpt = o.dir + "/checkpoint";
  // The example's default placement (device a quarter, host half, the rest of
  // the optimizer state on NVMe: a save reads it back and evicts to make room),
  // and all state fitting on host (the file path alone).
  parallel::EngineOptions spill;
  spill.precision = precision;
  spill.budgets = {round_up(state / 4, 4096), round_up(state / 2, 4096), round_up(state * 2, 4096)};
  spill.nvme_dir = o.dir + "/nvme";
  parallel::EngineOptions roomy = spill;
  roomy.budgets = {round_up(state / 4, 4096), round_up(state * 2, 4096), 0};
  std::vector<Measured> rows;
  rows.push_back(measure_checkpoint(mc, spill, ckpt, o.repeats));
  rows.back().placement = fmt::format("default: host {}, {} of {} families' state on NVMe",
                                      format_bytes(spill.budgets.host), rows.back().nvme_families, rows.back().families);
  rows.push_back(measure_checkpoint(mc, roomy, ckpt, o.repeats));
  rows.back().placement = fmt::format("all state fits on host ({})", format_bytes(roomy.budgets.host));
  const uint64_t bytes = rows.front().bytes;
  // Offline, from the last checkpoint saved: the export in Hugging Face's
  // layout and the conversion to one part, each from the disk (page cache dropped).
  drop_cache(ckpt);
  const checkpoint::ConvertStats exported = checkpoint::export_hf(ckpt, o.dir + "/hf", 1ull << 30, DType::kFloat32);
  drop_cache(ckpt);
  const checkpoint::ConvertStats converted = checkpoint::convert_single(ckpt, o.dir + "/single");
  const auto [store_write, store_read] = nvme_store_gbps(o.dir + "/raw", bytes);
  if (o.json) {
    nlohmann::json j = {{"size", o.size}, {"params", params}, {"precision", o.precision}, {"model_state_bytes", state},
                        {"checkpoint_bytes", bytes}, {"nvme_store_write_gbps", store_write},
                        {"nvme_store_read_gbps", store_read}};
    for (const Measured& m : rows) {
      j["rows"].push_back({{"placement", m.placement}, {"save_seconds", m.save_s}, {"load_seconds", m.load_s},
                           {"save_gbps", m.bytes / m.save_s / 1e9}, {"load_gbps", m.bytes / m.load_s / 1e9}});
    }
    j["export_hf"] = {{"bytes", exported.bytes}, {"seconds", exported.seconds},
                      {"gbps", exported.bytes / exported.seconds / 1e9}};
    j["convert_single"] = {{"bytes", converted.bytes}, {"seconds", converted.seconds},
                           {"gbps", converted.bytes / converted.seconds / 1e9}};
    fmt::print("{}\n", j.dump(1));
    return;
  }
  fmt::print("strata bench checkpoint: examples/gpt {} ({} parameters, {}), model state {}; checkpoint {} in {} files "
             "(median of {}); device budget {}\n",
             o.size, params, o.precision, format_bytes(state), format_bytes(bytes), rows.front().files, o.repeats,
             format_bytes(spill.budgets.device));
  fmt::print("{:<58} {:>10} {:>10} {:>10} {:>10}\n", "placement", "save GB/s", "save s", "load GB/s", "load s");
  for (const Measured& m : rows) {
    fmt::print("{:<58} {:>10.2f} {:>10.3f} {:>10.2f} {:>10.3f}\n", m.placement, m.bytes / m.save_s / 1e9, m.save_s,
               m.bytes / m.load_s / 1e9, m.load_s);
  }
  fmt::print("{:<58} {:>10.2f} {:>10.3f} {:>10} {:>10}\n",
             fmt::format("strata checkpoint export --hf (fp32 weights, {})", format_bytes(exported.bytes)),
             exported.bytes / exported.seconds / 1e9, exported.seconds, "-", "-");
  fmt::print("{:<58} {:>10.2f} {:>10.3f} {:>10} {:>10}\n",
             fmt::format("strata checkpoint convert --to-layout single ({})", format_bytes(converted.bytes)),
             converted.bytes / converted.seconds / 1e9, converted.seconds, "-", "-");
  fmt::print("{:<58} {:>10.2f} {:>10} {:>10.2f} {:>10}\n", "NVMe store, raw (O_DIRECT io_uring, same bytes)",
             store_write, "-", store_read, "-");
  fmt::print("a load reads every file twice: once to verify the checksums, once to load\n");
}

}  // namespace

void add_bench_checkpoint_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("checkpoint", "Engine::save and load of examples/gpt's model vs the NVMe store's raw rate");
  auto o = std::make_shared<CheckpointBenchOptions>();
  o->dir = (fs::temp_directory_path() / fmt::format("strata-bench-checkpoint-{}", ::getpid())).string();
  cmd->add_option("--size", o->size, "model size DIMxLAYERS");
  cmd->add_option("--precision", o->precision, "fp32, bf16 or fp16");
  cmd->add_option("--dir", o->dir, "directory on the disk to measure (removed after)");
  cmd->add_option("--repeats", o->repeats, "saves and loads timed (median reported)");
  cmd->add_flag("--json", o->json, "print one JSON document");
  cmd->callback([o] {
    std::error_code ec;
    try {
      run_checkpoint_bench(*o);
    } catch (...) {
      fs::remove_all(o->dir, ec);
      throw;
    }
    fs::remove_all(o->dir, ec);
  });
}

}  // namespace strata::tools
