// `strata bench checkpoint`: Engine::save and Engine::load of examples/gpt's
// model with its default placement (device a quarter of the model state, host
// half, the rest of the optimizer state on NVMe), in GB/s of checkpoint
// written or read, beside the NVMe store's raw write and read throughput over
// as many bytes in the same directory, measured in the same run. Loads read
// from the disk: the page cache is told to drop the files first.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "bench_timing.h"
#include "commands.h"
#include "gpt_model.h"
#include "strata/checkpoint/checkpoint_dir.h"
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

void run_checkpoint_bench(const CheckpointBenchOptions& o) {
  STRATA_CHECK(o.repeats >= 1, "--repeats must be at least 1");
  const examples::GptConfig mc = examples::parse_gpt_size(o.size, 64);
  torch::manual_seed(0);
  examples::Gpt model(mc);
  const DType precision = parse_dtype(o.precision);
  const int64_t params = examples::count_parameters(*model);
  const uint64_t state = static_cast<uint64_t>(params) * parallel::model_state_bytes_per_param(precision);
  parallel::EngineOptions eo;
  eo.precision = precision;
  eo.budgets = {round_up(state / 4, 4096), round_up(state / 2, 4096), round_up(state * 2, 4096)};
  eo.nvme_dir = o.dir + "/nvme";
  const std::string ckpt = o.dir + "/checkpoint";
  double save_s = 0, load_s = 0;
  uint64_t bytes = 0;
  size_t files = 0, nvme_families = 0, families = 0;
  {
    auto engine = parallel::attach(*model, parallel::AdamWConfig{}, eo);
    nvme_families = engine->nvme_optim_families();
    families = engine->num_families();
    for (int i = 0; i < 2; ++i) {  // optimizer state exists, and moved where it lives
      const torch::Tensor x = torch::randint(0, mc.vocab, {4, mc.context}), y = torch::randint(0, mc.vocab, {4, mc.context});
      engine->train_step([&] { return model->loss(x, y); });
    }
    std::vector<double> saves, loads;
    for (int r = 0; r < o.repeats; ++r) {
      saves.push_back(seconds([&] { engine->save(ckpt); }));
      drop_cache(ckpt);
      loads.push_back(seconds([&] { engine->load(ckpt); }));
    }
    save_s = median(saves);
    load_s = median(loads);
    const checkpoint::CheckpointReader r(ckpt);
    for (const auto& f : r.manifest().files) bytes += f.bytes;
    files = r.manifest().files.size() + 1;
  }
  const auto [store_write, store_read] = nvme_store_gbps(o.dir + "/raw", bytes);
  const double save_gbps = bytes / save_s / 1e9, load_gbps = bytes / load_s / 1e9;
  if (o.json) {
    nlohmann::json j = {{"size", o.size},           {"params", params},
                        {"precision", o.precision}, {"model_state_bytes", state},
                        {"checkpoint_bytes", bytes}, {"save_seconds", save_s},
                        {"load_seconds", load_s},   {"save_gbps", save_gbps},
                        {"load_gbps", load_gbps},   {"nvme_store_write_gbps", store_write},
                        {"nvme_store_read_gbps", store_read}};
    fmt::print("{}\n", j.dump(1));
    return;
  }
  fmt::print("strata bench checkpoint: examples/gpt {} ({} parameters, {}), model state {}; budgets device {}, host "
             "{}, nvme {}; optimizer state of {} of {} families on NVMe\n",
             o.size, params, o.precision, format_bytes(state), format_bytes(eo.budgets.device),
             format_bytes(eo.budgets.host), format_bytes(eo.budgets.nvme), nvme_families, families);
  fmt::print("checkpoint: {} in {} files at {} (median of {})\n", format_bytes(bytes), files, ckpt, o.repeats);
  fmt::print("{:<36} {:>9} {:>10}\n", "", "GB/s", "seconds");
  fmt::print("{:<36} {:>9.2f} {:>10.3f}\n", "Engine::save (fsync, atomic rename)", save_gbps, save_s);
  fmt::print("{:<36} {:>9.2f} {:>10.3f}\n", "Engine::load (verify, then load)", load_gbps, load_s);
  fmt::print("{:<36} {:>9.2f} {:>10}\n", "NVMe store write (raw, same bytes)", store_write, "-");
  fmt::print("{:<36} {:>9.2f} {:>10}\n", "NVMe store read (raw, same bytes)", store_read, "-");
  fmt::print("save at {:.0f}% of the store's write rate, load at {:.0f}% of its read rate (a load reads every file "
             "twice: once to verify the checksums, once to load)\n",
             100 * save_gbps / store_write, 100 * load_gbps / store_read);
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
