// `strata bench scale`: examples/gpt's model at billions of parameters (3B
// by default), constructed lazily, attached with the device budget at 1 GiB,
// the host at 12 GiB and the rest on NVMe, trained a few steps with every
// block checkpointed. It prints construction and attach time with peak RSS
// after each, and per step its time beside three figures measured or derived
// in the same run: the time of the bytes the step moved at the store's
// bandwidth (read bytes / its read bandwidth + written bytes / its write
// bandwidth, measured before the model is built); the least traffic any
// schedule of the step needs at that bandwidth (Note [The least traffic of a
// step], memory/traffic_bound.h); and the compute floor, the forward,
// recomputation and backward of the embedding and head and of one block
// measured with the parameters resident (plain LibTorch), the blocks summed.
// The step's ratio to max(least traffic, compute floor) is the figure; the
// goal is 1.5x. On the emulated device the device tier is host memory, so the
// RSS target is the host and device budgets + 1 GiB.
#include <fmt/format.h>
#include <sys/resource.h>
#include <malloc.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "commands.h"
#include "gpt_model.h"
#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/error.h"
#include "strata/memory/traffic_bound.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/lazy_init.h"

namespace strata::tools {
namespace {

namespace mem = memory;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct ScaleBenchOptions {
  std::string params = "3b";  // parameter count: 3b, 1.5b, 800m, 125000000
  int dim = 3072;
  int heads = 24;
  int layers = 0;  // 0: from --params
  int context = 64;
  int batch = 1;
  int steps = 2;
  std::string precision = "fp32";
  std::string device = "1GiB", host = "12GiB", nvme = "40GiB";
  std::string nvme_dir;
  std::string store_probe = "1GiB";
  bool json = false;
  bool update_in_backward = false;
};

// "3b", "1.5B", "800m", "125000000" -> a count.
double parse_count(const std::string& s) {
  STRATA_CHECK(!s.empty(), "--params is empty; give a count such as 3b, 1.5b or 800m");
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  const std::string unit(end);
  double scale = 1;
  if (unit == "b" || unit == "B") scale = 1e9;
  else if (unit == "m" || unit == "M") scale = 1e6;
  else if (unit == "k" || unit == "K") scale = 1e3;
  else STRATA_CHECK(unit.empty(), "--params ", s, ": use a number with k, m or b (3b, 1.5b, 800m)");
  STRATA_CHECK(end != s.c_str() && v > 0 && std::isfinite(v), "--params ", s, " is not a positive count");
  return v * scale;
}

// Peak and current resident memory of this process; the peak reset to now.
uint64_t status_bytes(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(status, line)) {
    if (line.rfind(key, 0) == 0) return std::stoull(line.substr(key.size())) << 10;
  }
  return 0;
}
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }
// Page faults served without I/O so far (the heap's and the host arena's pages faulting in).
uint64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<uint64_t>(u.ru_minflt);
}

struct Traffic {
  uint64_t read = 0, written = 0;  // bytes from and to the NVMe tier
};
Traffic nvme_traffic(const mem::MoveStats& m) {
  Traffic t;
  for (int k = 0; k < mem::kNumTiers; ++k) {
    t.read += m.bytes[static_cast<int>(mem::Tier::kNvme)][k];
    t.written += m.bytes[k][static_cast<int>(mem::Tier::kNvme)];
  }
  return t;
}

// The fastest of `reps` forward + loss + backward passes of gpt_layers(c),
// resident in plain LibTorch (after one warm-up pass).
double resident_step_seconds(const examples::GptConfig& c, torch::ScalarType dtype, int batch, int reps) {
  torch::manual_seed(1);
  torch::nn::Sequential m = examples::gpt_layers(c);
  m->to(dtype);
  const torch::Tensor tokens = torch::randint(0, c.vocab, {batch, c.context + 1});
  const torch::Tensor x = tokens.slice(1, 0, c.context), y = tokens.slice(1, 1, c.context + 1);
  double best = 0;
  for (int r = 0; r <= reps; ++r) {
    for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
    const auto t = Clock::now();
    examples::gpt_loss(m->forward(x), y).backward();
    const double s = since(t);
    if (r == 1 || (r > 1 && s < best)) best = s;
  }
  return best;
}

struct ComputeFloor {
  double ends = 0, block = 0, total = 0;  // embedding and head; one block; all of it
};
ComputeFloor compute_floor(examples::GptConfig c, torch::ScalarType dtype, int batch) {
  ComputeFloor f;
  c.layers = 0;
  f.ends = resident_step_seconds(c, dtype, batch, 2);
  c.layers = 1;
  f.block = std::max(0.0, resident_step_seconds(c, dtype, batch, 2) - f.ends);
  return f;
}

void run_scale_bench(const ScaleBenchOptions& o) {
  namespace fs = std::filesystem;
  examples::GptConfig mc;
  mc.dim = o.dim;
  mc.heads = o.heads;
  mc.context = o.context;
  mc.checkpoint_blocks = true;
  mc.tied_head = true;  // examples/gpt --preset 3b's model
  const double wanted = parse_count(o.params);
  mc.layers = o.layers > 0 ? o.layers
                           : std::max(1, static_cast<int>(std::lround(wanted / (12.0 * o.dim * static_cast<double>(o.dim)))));
  parallel::EngineOptions eo;
  eo.budgets = {parse_bytes(o.device), parse_bytes(o.host), parse_bytes(o.nvme)};
  eo.nvme_dir = o.nvme_dir.empty() ? (fs::temp_directory_path() / "strata-bench-scale").string() : o.nvme_dir;
  eo.clip_norm = 1.0;
  eo.update_in_backward = o.update_in_backward;
  eo.precision = parse_dtype(o.precision);
  const torch::ScalarType compute = eo.precision == DType::kFloat32    ? torch::kFloat32
                                    : eo.precision == DType::kBFloat16 ? torch::kBFloat16
                                                                        : torch::kFloat16;
  STRATA_CHECK(!fs::exists(eo.nvme_dir) || fs::is_empty(eo.nvme_dir), "--nvme-dir ", eo.nvme_dir,
               " is not empty; give an empty or new directory (the benchmark removes what it writes there)");

  // The store's own bandwidth, on the disk the tier will use, before anything fills it.
  const std::string probe = (fs::path(eo.nvme_dir) / "probe").string();
  const auto [write_gbps, read_gbps] = nvme_store_gbps(probe, parse_bytes(o.store_probe));
  fs::remove_all(probe);
  ComputeFloor floor = compute_floor(mc, compute, o.batch);
  floor.total = floor.ends + mc.layers * floor.block;
  ::malloc_trim(0);  // what the resident models freed leaves the heap: the peak below is the engine's

  reset_peak_rss();
  const uint64_t rss0 = status_bytes("VmRSS");
  torch::manual_seed(0);
  auto t = Clock::now();
  torch::nn::Sequential model{nullptr};
  {
    parallel::LazyInit lazy;
    model = examples::gpt_layers(mc);
  }
  const double build_s = since(t);
  const uint64_t build_peak = status_bytes("VmHWM") - rss0;
  const int64_t params = examples::count_parameters(*model);
  const uint64_t state = static_cast<uint64_t>(params) * parallel::model_state_bytes_per_param(eo.precision);

  t = Clock::now();
  auto engine = parallel::attach(*model, parallel::AdamWConfig{1e-5}, eo);
  const double attach_s = since(t);
  const uint64_t attach_peak = status_bytes("VmHWM") - rss0;
  const memory::StepState step_state = engine->step_state();
  const memory::TrafficBound least = memory::least_step_traffic(step_state);
  const double least_s = least.steady.seconds(read_gbps, write_gbps);
  const double target_s = std::max(least_s, floor.total);
  const std::optional<memory::Traffic> most =
      step_state.global_barrier ? std::nullopt : memory::most_traffic_updating_in_backward(step_state);

  if (!o.json) {
    fmt::print("strata bench scale: examples/gpt, {} layers x dim {} ({} parameters, {:.2f} B; model state {}), "
               "batch {} x context {}, {}, every block checkpointed\n",
               mc.layers, mc.dim, params, params / 1e9, format_bytes(state), o.batch, o.context, o.precision);
    fmt::print("budgets: device {} ({}), host {}, nvme {} in {}; {} chunk families\n", format_bytes(eo.budgets.device),
               engine->chunks().device().name(), format_bytes(eo.budgets.host), format_bytes(eo.budgets.nvme), eo.nvme_dir,
               engine->num_families());
    fmt::print("nvme store (the ceiling): write {:.2f} GB/s, read {:.2f} GB/s over {}\n", write_gbps, read_gbps,
               o.store_probe);
    fmt::print("construction (lazy): {:.1f} s, peak RSS +{}\n", build_s, format_bytes(build_peak));
    fmt::print("attach (materialise into chunks): {:.1f} s, peak RSS +{}\n", attach_s, format_bytes(attach_peak));
    fmt::print("least NVMe traffic of a step (Note [The least traffic of a step]; state {}, gradients {}, memory {}{}): "
               "{} read + {} written, {:.1f} s at the store's bandwidth, on average over steps; {} for one step alone\n",
               format_bytes(step_state.persistent), format_bytes(step_state.gradients), format_bytes(step_state.memory),
               step_state.global_barrier ? "" : "; updates in backward, no global fact before them",
               format_bytes(least.steady.read), format_bytes(least.steady.written), least_s,
               format_bytes(least.one_step.total()));
    if (!step_state.global_barrier) {
      memory::StepState exact = step_state;
      exact.global_barrier = true;
      const memory::TrafficBound b = memory::least_step_traffic(exact);
      fmt::print("  (with a global fact before the updates, as without --update-in-backward: {} read + {} written, "
                 "{:.1f} s)\n", format_bytes(b.steady.read), format_bytes(b.steady.written),
                 b.steady.seconds(read_gbps, write_gbps));
      if (most) {
        fmt::print("  (the most a steady step of updates in backward moves, Note [What an update in backward cannot "
                   "keep]: {} read + {} written; chunks kept between steps {}, host {}, largest update {})\n",
                   format_bytes(most->read), format_bytes(most->written), format_bytes(step_state.stored),
                   format_bytes(step_state.host), format_bytes(step_state.largest_update));
      } else {
        fmt::print("  (no ceiling for updates in backward: the parameter chunks, {}, do not fit in the host beside "
                   "three updates, Note [What an update in backward cannot keep])\n",
                   format_bytes(step_state.parameters));
      }
    }
    fmt::print("compute floor (resident forward, recomputation and backward): embedding and head {:.2f} s + {} blocks x "
               "{:.2f} s = {:.1f} s\n", floor.ends, mc.layers, floor.block, floor.total);
    fmt::print("{:<5} {:>9} {:>11} {:>11} {:>9} {:>8} {:>8} {:>8} {:>10}\n", "step", "time s", "nvme read",
               "nvme write", "moved s", "least s", "floor s", "ratio", "loss");
  }
  nlohmann::json steps = nlohmann::json::array();
  double total_s = 0;
  for (int s = 1; s <= o.steps; ++s) {
    const torch::Tensor tokens = torch::randint(0, mc.vocab, {o.batch, o.context + 1});
    const torch::Tensor x = tokens.slice(1, 0, o.context), y = tokens.slice(1, 1, o.context + 1);
    const parallel::Engine::DataWait wait_before = engine->data_wait();
    const mem::MoveStats moves_before = engine->chunks().move_stats();
    const Traffic before = nvme_traffic(moves_before);
    const uint64_t faults_before = minor_faults();
    t = Clock::now();
    const parallel::StepResult result = engine->train_step([&] { return examples::gpt_loss(model->forward(x), y); });
    const double loss = result.loss;
    const double step_s = since(t);
    const uint64_t faults = minor_faults() - faults_before;
    total_s += step_s;
    const mem::MoveStats moves_after = engine->chunks().move_stats();
    const parallel::Engine::DataWait wait_after = engine->data_wait();
    const double wait_ops = wait_after.operators - wait_before.operators;
    const double wait_optim = wait_after.optimizer - wait_before.optimizer;
    const Traffic after = nvme_traffic(moves_after);
    // The step's NVMe traffic by what moved: each role's bytes read / written.
    nlohmann::json by_role = nlohmann::json::object();
    std::string roles;
    const mem::MoveStats moved = moves_after - moves_before;
    for (size_t r = 0; r < moved.nvme_read_by_role.size(); ++r) {
      const uint64_t rd = moved.nvme_read_by_role[r];
      const uint64_t wr = moved.nvme_written_by_role[r];
      const uint64_t demand = moved.nvme_demand_read_by_role[r];
      // Note [Clean copies on NVMe]: evictions that found their copy unchanged and wrote nothing.
      const uint64_t kept = moved.nvme_kept_by_role[r];
      const char* name = mem::chunk_role_name(static_cast<mem::ChunkRole>(r));
      by_role[name] = {{"read_bytes", rd}, {"demand_read_bytes", demand}, {"written_bytes", wr},
                       {"kept_clean_bytes", kept}};
      if (rd + wr + kept > 0) {
        roles += fmt::format("{}{} {} ({} on demand) / {}", roles.empty() ? "" : ", ", name, format_bytes(rd),
                             format_bytes(demand), format_bytes(wr));
        if (kept > 0) roles += fmt::format(" (+{} clean, not written)", format_bytes(kept));
      }
    }
    const uint64_t read = after.read - before.read, written = after.written - before.written;
    const double moved_s = memory::Traffic{read, written}.seconds(read_gbps, write_gbps);
    const double ratio = target_s > 0 ? step_s / target_s : 0;
    steps.push_back({{"step", s}, {"seconds", step_s}, {"nvme_read_bytes", read}, {"nvme_written_bytes", written},
                     {"moved_seconds", moved_s}, {"ratio_to_moved", moved_s > 0 ? step_s / moved_s : 0},
                     {"ratio_to_least", ratio}, {"loss", loss}, {"nvme_by_role", by_role},
                     {"operators_waited_seconds", wait_ops}, {"optimizer_waited_seconds", wait_optim},
                     {"families_updated_in_backward", result.updated_in_backward}, {"minor_page_faults", faults}});
    if (!o.json) {
      const offload::HostArenaStats arena = engine->chunks().host_arena().stats();
      fmt::print("{:<5} {:>9.1f} {:>11} {:>11} {:>9.1f} {:>8.1f} {:>8.1f} {:>7.2f}x {:>10.4f}   RSS {} (host arena: {} "
                 "mapped, {} live, {} of it in huge pages; {} page faults)\n",
                 s, step_s, format_bytes(read), format_bytes(written), moved_s, least_s, floor.total, ratio, loss,
                 format_bytes(status_bytes("VmRSS")), format_bytes(arena.mapped_bytes),
                 format_bytes(arena.allocated_bytes), format_bytes(arena.huge_page_bytes), faults);
      fmt::print("      nvme read / written by role: {}; waited for chunks: operators {:.1f} s, optimizer {:.1f} s{}\n",
                 roles.empty() ? "none" : roles, wait_ops, wait_optim,
                 o.update_in_backward ? fmt::format("; {} of {} families updated in backward", result.updated_in_backward,
                                                    engine->num_families())
                                      : std::string());
      std::fflush(stdout);
    }
  }
  // The probe again, the tier idle: a disk shared with others (or still
  // freeing a previous run's files) can probe slow once, and a bound no
  // schedule beats takes the faster of the two.
  const auto [write_after, read_after] = nvme_store_gbps(probe, parse_bytes(o.store_probe));
  fs::remove_all(probe);
  const double best_write = std::max(write_gbps, write_after), best_read = std::max(read_gbps, read_after);
  const double best_target_s = std::max(least.steady.seconds(best_read, best_write), floor.total);
  std::string best_ratios;
  for (auto& step : steps) {
    const double r = step["seconds"].get<double>() / best_target_s;
    step["ratio_to_least_faster_probe"] = r;
    best_ratios += fmt::format("{}{:.2f}x", best_ratios.empty() ? "" : ", ", r);
  }
  if (!o.json) {
    fmt::print("nvme store after the steps: write {:.2f} GB/s, read {:.2f} GB/s; at the faster of the two probes the "
               "least traffic takes {:.1f} s, and the steps are {} of max(least, floor)\n",
               write_after, read_after, least.steady.seconds(best_read, best_write), best_ratios);
  }
  const uint64_t peak = status_bytes("VmHWM") - rss0;
  const bool emulated = engine->chunks().device().kind() == offload::DeviceKind::kEmulated;
  const uint64_t target = eo.budgets.host + (emulated ? eo.budgets.device : 0) + (uint64_t{1} << 30);
  const mem::TierStats nvme = engine->chunks().tier_stats(mem::Tier::kNvme);
  const double tokens_per_s = o.steps * o.batch * o.context / total_s;
  if (o.json) {
    nlohmann::json j{{"layers", mc.layers},        {"dim", mc.dim},
                     {"parameters", params},       {"model_state_bytes", state}, {"precision", o.precision},
                     {"budgets", {{"device", eo.budgets.device}, {"host", eo.budgets.host}, {"nvme", eo.budgets.nvme}}},
                     {"store_write_gbps", write_gbps}, {"store_read_gbps", read_gbps},
                     {"store_after_write_gbps", write_after}, {"store_after_read_gbps", read_after},
                     {"construction_seconds", build_s}, {"construction_peak_rss_bytes", build_peak},
                     {"attach_seconds", attach_s}, {"attach_peak_rss_bytes", attach_peak},
                     {"least_traffic", {{"state_bytes", step_state.persistent},
                                        {"gradient_bytes", step_state.gradients},
                                        {"memory_bytes", step_state.memory},
                                        {"steady_read_bytes", least.steady.read},
                                        {"steady_written_bytes", least.steady.written},
                                        {"one_step_bytes", least.one_step.total()},
                                        {"seconds", least_s}}},
                     {"most_updating_in_backward",
                      most ? nlohmann::json{{"read_bytes", most->read}, {"written_bytes", most->written}}
                           : nlohmann::json(nullptr)},
                     {"compute_floor", {{"ends_seconds", floor.ends}, {"block_seconds", floor.block},
                                        {"seconds", floor.total}}},
                     {"steps", steps},              {"peak_rss_bytes", peak},
                     {"rss_target_bytes", target},  {"nvme_peak_bytes", nvme.peak},
                     {"tokens_per_second", tokens_per_s}};
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("tokens/s {:.2f}; nvme tier peak {} of budget {} (with the clean copies kept for chunks above it: "
               "{} at the end)\n",
               tokens_per_s, format_bytes(nvme.peak), format_bytes(nvme.budget), format_bytes(nvme.kept));
    fmt::print("peak RSS +{} against the target {} (host budget{} + 1 GiB): {}\n", format_bytes(peak),
               format_bytes(target), emulated ? " + emulated device budget" : "",
               peak <= target ? "within" : "over");
  }
  t = Clock::now();
  engine.reset();
  if (!o.json) {
    fmt::print("engine destroyed in {:.1f} s; RSS {}, peak RSS +{}\n", since(t), format_bytes(status_bytes("VmRSS")),
               format_bytes(status_bytes("VmHWM") - rss0));
  }
  fs::remove_all(eo.nvme_dir);
}

}  // namespace

void add_bench_scale_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("scale", "examples/gpt at billions of parameters, lazily constructed, on NVMe: "
                                            "step time against the least NVMe traffic and the compute floor, "
                                            "peak RSS against the budgets");
  auto o = std::make_shared<ScaleBenchOptions>();
  cmd->add_option("--params", o->params, "parameter count (3b, 1.5b, 800m); sets the layers at --dim")
      ->capture_default_str();
  cmd->add_option("--layers", o->layers, "transformer blocks (overrides --params)");
  cmd->add_option("--dim", o->dim, "model width")->capture_default_str();
  cmd->add_option("--heads", o->heads, "attention heads")->capture_default_str();
  cmd->add_option("--context", o->context, "tokens per sequence")->capture_default_str();
  cmd->add_option("--batch", o->batch, "sequences per step")->capture_default_str();
  cmd->add_option("--precision", o->precision, "fp32, bf16 or fp16")->capture_default_str();
  cmd->add_option("--steps", o->steps, "training steps")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--device-budget", o->device, "device tier budget")->capture_default_str();
  cmd->add_option("--host-budget", o->host, "host tier budget")->capture_default_str();
  cmd->add_option("--nvme-budget", o->nvme, "NVMe tier budget")->capture_default_str();
  cmd->add_option("--nvme-dir", o->nvme_dir, "an empty directory for the NVMe tier (default: $TMPDIR/strata-bench-scale)");
  cmd->add_option("--store-probe", o->store_probe, "bytes the store's bandwidth is measured over")->capture_default_str();
  cmd->add_flag("--update-in-backward", o->update_in_backward,
                "update each family in backward as soon as its gradients are final, clipped by the norm as far as "
                "backward knows it (EngineOptions::update_in_backward)");
  cmd->add_flag("--json", o->json, "print one JSON document");
  cmd->callback([o] { run_scale_bench(*o); });
}

}  // namespace strata::tools
