// `strata bench optim`: CPU optimizer kernels against a bandwidth probe that
// moves the same bytes over the same arrays, and against torch::optim::AdamW,
// all measured in the same run. Also times a whole mixed-precision optimizer
// phase (grad norm + overflow check, clip, fused update) against the update alone.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench_timing.h"
#include "bench_torch.h"
#include "bench_optim_cuda.h"
#include "commands.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/kernels/isa.h"
#include "strata/kernels/optim.h"
#include "strata/kernels/thread_pool.h"

namespace strata::tools {

namespace {

using kernels::OptimSpans;

struct OptimBenchOptions {
  int64_t params = 64 << 20;
  std::vector<int> threads;
  int iters = 7;
  bool json = false;
  bool torch_baseline = true;
  bool cuda = false;  // also the CUDA kernels (bench_optim_cuda.h)
};

// Median seconds of `a` and of `b` over `iters` alternating runs after a
// warm-up of each: on a shared, noisy machine both see the same conditions,
// so their ratio is meaningful even when absolute times drift.
std::pair<double, double> time_pair(int iters, const std::function<void()>& a, const std::function<void()>& b) {
  a();
  b();
  std::vector<double> ta, tb;
  for (int i = 0; i < iters; ++i) {
    ta.push_back(seconds(a));
    tb.push_back(seconds(b));
  }
  return {median(ta), median(tb)};
}

// Page-aligned, first-touched by the kernel pool (so pages land where the threads run).
struct Arrays {
  int64_t n;
  std::vector<float> master, m, v;
  std::vector<unsigned char> grad, copy;
  Arrays(int64_t n_, DType grad_dtype, bool copy_needed)
      : n(n_), master(n_), m(n_), v(n_), grad(n_ * dtype_size(grad_dtype)), copy(copy_needed ? n_ * 2 : 0) {
    for (int64_t i = 0; i < n; ++i) {
      master[i] = 0.01f * static_cast<float>(i % 997);
      v[i] = 1e-4f;
    }
    std::memset(grad.data(), 0x3c, grad.size());  // small finite values in every dtype
  }
  OptimSpans spans(DType grad_dtype, DType param_dtype, bool two_states) {
    OptimSpans s;
    s.n = n;
    s.master = master.data();
    s.grad = grad.data();
    s.grad_dtype = grad_dtype;
    s.state0 = m.data();
    s.state1 = two_states ? v.data() : nullptr;
    s.param_dtype = param_dtype;
    s.param_copy = param_dtype == DType::kFloat32 ? nullptr : copy.data();
    return s;
  }
};

struct Row {
  std::string optimizer, grad, param;
  int threads;
  double params_per_s, gbps, probe_gbps, ratio, torch_params_per_s;
};

size_t bytes_per_param(DType grad, DType param, bool two_states) {
  // read grad, master, states; write master, states and the copy.
  return dtype_size(grad) + 8 + 8 * (two_states ? 2 : 1) + (param == DType::kFloat32 ? 0 : dtype_size(param));
}

void run_optim_bench(const OptimBenchOptions& o) {
  struct Combo {
    DType grad, param;
  };
  const Combo combos[] = {{DType::kFloat32, DType::kFloat32}, {DType::kBFloat16, DType::kBFloat16},
                          {DType::kFloat16, DType::kFloat16}};
  const char* optimizers[] = {"adamw", "adam", "lion", "sgd"};
  std::vector<Row> rows;
  if (!o.json) {
    fmt::print("strata bench optim: {} parameters per chunk, ISA {}, median of {} runs alternating with the probe\n", o.params,
               kernels::isa_name(kernels::selected_isa()), o.iters);
    fmt::print("{:<7} {:>5} {:>5} {:>7} {:>11} {:>9} {:>10} {:>8} {:>13}\n", "optim", "grad", "param", "threads",
               "Gparams/s", "GB/s", "probe GB/s", "ratio", "torch Gp/s");
  }
  for (int threads : o.threads) {
    kernels::set_kernel_threads(threads);
    for (const Combo& c : combos) {
      Arrays a(o.params, c.grad, c.param != DType::kFloat32);
      for (const char* name : optimizers) {
        const std::string opt = name;
        const bool two_states = opt == "adamw" || opt == "adam";
        const OptimSpans s = a.spans(c.grad, c.param, two_states);
        const double bytes = static_cast<double>(bytes_per_param(c.grad, c.param, two_states)) * o.params;
        std::function<void()> step;
        if (two_states) {
          kernels::AdamParams p;
          p.decoupled_weight_decay = opt == "adamw";
          p.weight_decay = 0.01f;
          p.grads_known_finite = true;
          step = [p, s] { kernels::adam_step(p, s); };
        } else if (opt == "lion") {
          kernels::LionParams p;
          p.grads_known_finite = true;
          step = [p, s] { kernels::lion_step(p, s); };
        } else {
          kernels::SgdParams p;
          p.step = 2;
          p.grads_known_finite = true;
          step = [p, s] { kernels::sgd_step(p, s); };
        }
        const auto [t, tp] = time_pair(o.iters, step, [s] { kernels::rmw_probe(s); });
        Row r{opt, dtype_name(c.grad), dtype_name(c.param), threads, o.params / t, bytes / t / 1e9, bytes / tp / 1e9,
              tp / t, 0.0};
        if (o.torch_baseline && opt == "adamw" && c.grad == DType::kFloat32 && torch_available()) {
          r.torch_params_per_s = o.params / torch_adamw_seconds(o.params, threads, o.iters);
        }
        if (!o.json) {
          fmt::print("{:<7} {:>5} {:>5} {:>7} {:>11.3f} {:>9.2f} {:>10.2f} {:>7.1f}% {:>13}\n", r.optimizer, r.grad,
                     r.param, r.threads, r.params_per_s / 1e9, r.gbps, r.probe_gbps, 100 * r.ratio,
                     r.torch_params_per_s > 0 ? fmt::format("{:.3f}", r.torch_params_per_s / 1e9) : "-");
        }
        rows.push_back(r);
      }
    }
  }

  // The whole optimizer phase of a mixed-precision step over several chunks.
  const int chunks = 4;
  const int64_t per_chunk = o.params / chunks;
  kernels::set_kernel_threads(o.threads.back());
  std::vector<Arrays> family;
  for (int i = 0; i < chunks; ++i) family.emplace_back(per_chunk, DType::kBFloat16, true);
  const float loss_scale = 1024.0f;
  auto update_all = [&](float grad_scale) {
    kernels::AdamParams p;
    p.grad_scale = grad_scale;
    p.grads_known_finite = true;
    for (auto& a : family) kernels::adam_step(p, a.spans(DType::kBFloat16, DType::kBFloat16, true));
  };
  const auto [t_update, t_phase] = time_pair(o.iters, [&] { update_all(1.0f / loss_scale); }, [&] {
    kernels::GradStats total;
    for (auto& a : family) total.merge(kernels::grad_stats(a.grad.data(), DType::kBFloat16, per_chunk));
    STRATA_ASSERT(total.finite, "benchmark gradients are finite");
    const double norm = std::sqrt(total.sum_sq) / loss_scale;
    update_all(kernels::clip_coefficient(norm, 1.0) / loss_scale);
  });
  std::vector<CudaOptimRow> cuda_rows;
  if (o.cuda) {
#if defined(STRATA_HAVE_CUDA_KERNELS)
    cuda_rows = run_cuda_optim_rows(o.params, o.iters);
#else
    STRATA_FAIL("bench optim --cuda: this strata was built without its CUDA kernels (no CUDA toolkit at build time)");
#endif
  }
  if (o.json) {
    nlohmann::json j;
    j["params"] = o.params;
    for (const CudaOptimRow& r : cuda_rows) {
      j["cuda_rows"].push_back({{"optimizer", r.optimizer}, {"grad", r.grad}, {"param", r.param},
                                {"params_per_s", r.params_per_s}, {"gbps", r.gbps}, {"probe_gbps", r.probe_gbps},
                                {"ratio_to_probe", r.ratio}});
    }
    j["isa"] = kernels::isa_name(kernels::selected_isa());
    for (const Row& r : rows) {
      j["rows"].push_back({{"optimizer", r.optimizer}, {"grad", r.grad}, {"param", r.param}, {"threads", r.threads},
                           {"params_per_s", r.params_per_s}, {"gbps", r.gbps}, {"probe_gbps", r.probe_gbps},
                           {"ratio_to_probe", r.ratio}, {"torch_adamw_params_per_s", r.torch_params_per_s}});
    }
    j["phase"] = {{"chunks", chunks}, {"threads", o.threads.back()}, {"update_s", t_update}, {"phase_s", t_phase},
                  {"ratio", t_phase / t_update}};
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("\nmixed-precision optimizer phase, {} chunks x {} params, bf16 grads and params, {} threads:\n",
               chunks, per_chunk, o.threads.back());
    fmt::print("  update alone {:.2f} ms; norm + overflow check + unscale + clip + update {:.2f} ms; ratio {:.3f}x\n",
               1e3 * t_update, 1e3 * t_phase, t_phase / t_update);
    if (!cuda_rows.empty()) {
      fmt::print("\nCUDA kernels on GPU 0, {} parameters, against a device-to-device copy of the same bytes:\n",
                 o.params);
      fmt::print("{:<7} {:>5} {:>5} {:>11} {:>9} {:>10} {:>8}\n", "optim", "grad", "param", "Gparams/s", "GB/s",
                 "probe GB/s", "ratio");
      for (const CudaOptimRow& r : cuda_rows) {
        fmt::print("{:<7} {:>5} {:>5} {:>11.3f} {:>9.1f} {:>10.1f} {:>7.1f}%\n", r.optimizer, r.grad, r.param,
                   r.params_per_s / 1e9, r.gbps, r.probe_gbps, 100 * r.ratio);
      }
    }
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks, each printed beside a ceiling measured in the same run");
  bench->require_subcommand(1);
  add_bench_nvme_command(*bench);
#if defined(STRATA_HAVE_TORCH)
  add_bench_step_command(*bench);
  add_bench_checkpoint_command(*bench);
  add_bench_scale_command(*bench);
#if defined(STRATA_HAVE_GLOO)
  add_bench_comm_command(*bench);
  add_bench_pipeline_command(*bench);
  add_bench_sequence_command(*bench);
  add_bench_tp_command(*bench);
  add_bench_hybrid_command(*bench);
#endif
#endif
  auto* optim = bench->add_subcommand("optim", "CPU optimizer kernels vs a bandwidth probe and torch::optim::AdamW");
  auto o = std::make_shared<OptimBenchOptions>();
  auto size = std::make_shared<std::string>("64M");
  optim->add_option("--params", *size, "parameters per chunk, e.g. 64M or 1048576 (M = 2^20)");
  optim->add_option("--threads", o->threads, "thread counts to sweep (default: 1 and all cores)")->delimiter(',');
  optim->add_option("--iters", o->iters, "timed runs per figure (median reported)")->check(CLI::PositiveNumber);
  optim->add_flag("--json", o->json, "print one JSON document");
  optim->add_flag("!--no-torch", o->torch_baseline, "skip the torch::optim::AdamW baseline");
  optim->add_flag("--cuda", o->cuda, "also the CUDA kernels on GPU 0 against a device-to-device copy of the same bytes");
  optim->callback([o, size] {
    std::string s = *size;
    if (!s.empty() && (s.back() == 'M' || s.back() == 'K')) s += "iB";  // element counts use binary multiples
    const uint64_t n = parse_bytes(s);
    STRATA_CHECK(n >= 1024, "--params must be at least 1024, got ", *size);
    o->params = static_cast<int64_t>(n);
    if (o->threads.empty()) {
      const int all = kernels::kernel_threads();
      o->threads = all > 1 ? std::vector<int>{1, all} : std::vector<int>{1};
    }
    run_optim_bench(*o);
  });
}

}  // namespace strata::tools
