// `strata info`: what the runtime sees on this machine.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "strata/core/bytes.h"
#include "strata/kernels/isa.h"
#include "strata/offload/cuda_runtime.h"
#include "strata/offload/host_arena.h"
#include "strata/offload/io_uring_probe.h"
#include "strata/offload/topology.h"

#if defined(STRATA_HAVE_TORCH)
#include <torch/csrc/api/include/torch/version.h>
#endif
#if defined(STRATA_HAVE_GLOO)
#include <gloo/config.h>
#endif
#if defined(STRATA_HAVE_NCCL)
#include <nccl.h>
#endif

namespace strata::tools {

namespace {

struct Info {
  offload::MachineTopology topo;
  kernels::CpuFeatures features;
  kernels::Isa best = kernels::Isa::kScalar;
  kernels::Isa selected = kernels::Isa::kScalar;
  offload::cuda::RuntimeInfo cuda;
  offload::IoUringSupport uring;
  std::string jemalloc;
  std::string libtorch;
  std::string gloo;
  bool nccl_compiled = false;
  int nccl_version = 0;  // e.g. 22703, from ncclGetVersion (the library loaded, not the header)
};

Info gather() {
  Info i;
  i.topo = offload::machine_topology();
  i.features = kernels::detect_cpu_features();
  i.best = kernels::best_isa(i.features);
  i.selected = kernels::selected_isa();
  i.cuda = offload::cuda::probe();
  i.uring = offload::probe_io_uring();
  i.jemalloc = offload::jemalloc_version();
#if defined(STRATA_HAVE_TORCH)
  i.libtorch = TORCH_VERSION;
#else
  i.libtorch = "not built (STRATA_WITH_TORCH=OFF)";
#endif
#if defined(STRATA_HAVE_GLOO)
  i.gloo = fmt::format("{}.{}.{}", GLOO_VERSION_MAJOR, GLOO_VERSION_MINOR, GLOO_VERSION_PATCH);
#else
  i.gloo = "not found";
#endif
#if defined(STRATA_HAVE_NCCL)
  i.nccl_compiled = true;
  if (ncclGetVersion(&i.nccl_version) != ncclSuccess) i.nccl_version = NCCL_VERSION_CODE;
#endif
  return i;
}

std::string devices_line(const Info& i) {
  if (i.cuda.devices.empty()) {
    return "none: device tier emulated in host memory" + (i.cuda.error.empty() ? "" : " (" + i.cuda.error + ")");
  }
  std::string out;
  for (const auto& d : i.cuda.devices) {
    out += fmt::format("{}cuda:{} {} (sm_{}{}), {} total, {} free", out.empty() ? "" : "; ", d.index, d.name,
                       d.compute_major, d.compute_minor, format_bytes(d.total_bytes), format_bytes(d.free_bytes));
  }
  return out;
}

void print_text(const Info& i) {
  const auto& t = i.topo;
  fmt::print("strata {}\n", STRATA_VERSION);
  fmt::print("{:<10}{}, {} package(s), {} cores, {} hardware threads\n", "cpu:", t.cpu_model, t.packages, t.cores,
             t.hardware_threads);
  std::string numa = fmt::format("{} node(s)", t.numa_nodes.size());
  for (const auto& n : t.numa_nodes) numa += fmt::format(", node {}: {}", n.os_index, format_bytes(n.local_memory_bytes));
  fmt::print("{:<10}{}\n", "numa:", numa);
  fmt::print("{:<10}{} selected (best supported: {})\n", "simd:", kernels::describe_isa(i.selected, i.features),
             kernels::isa_name(i.best));
  fmt::print("{:<10}{}\n", "devices:", devices_line(i));
  if (i.cuda.compiled) {
    fmt::print("{:<10}runtime {}, driver {}\n", "cuda:", offload::cuda::format_cuda_version(i.cuda.runtime_version),
               i.cuda.driver_version ? offload::cuda::format_cuda_version(i.cuda.driver_version) : "none");
  } else {
    fmt::print("{:<10}not compiled (no CUDA toolkit at build time)\n", "cuda:");
  }
  fmt::print("{:<10}{}\n", "nccl:",
             i.nccl_compiled ? offload::cuda::format_nccl_version(i.nccl_version) : "not compiled");
  fmt::print("{:<10}{} ({}); kernel {}; liburing {}\n", "io_uring:", i.uring.available ? "available" : "unavailable",
             i.uring.detail, i.uring.kernel_release, i.uring.liburing_version);
  fmt::print("{:<10}{}\n", "jemalloc:", i.jemalloc);
  fmt::print("{:<10}{}\n", "libtorch:", i.libtorch);
  fmt::print("{:<10}{}\n", "gloo:", i.gloo);
  fmt::print("{:<10}{}\n", "hwloc:", t.hwloc_version);
}

void print_json(const Info& i) {
  nlohmann::json j;
  j["version"] = STRATA_VERSION;
  j["cpu"] = {{"model", i.topo.cpu_model},
              {"packages", i.topo.packages},
              {"cores", i.topo.cores},
              {"hardware_threads", i.topo.hardware_threads}};
  j["numa_nodes"] = nlohmann::json::array();
  for (const auto& n : i.topo.numa_nodes) j["numa_nodes"].push_back({{"os_index", n.os_index}, {"bytes", n.local_memory_bytes}});
  j["simd"] = {{"selected", kernels::isa_name(i.selected)}, {"best", kernels::isa_name(i.best)},
               {"avx512_bf16", i.features.avx512bf16}};
  j["cuda"] = {{"compiled", i.cuda.compiled}, {"runtime_version", i.cuda.runtime_version},
               {"driver_version", i.cuda.driver_version}, {"error", i.cuda.error},
               {"nccl_compiled", i.nccl_compiled}, {"nccl_version", i.nccl_version}};
  j["devices"] = nlohmann::json::array();
  for (const auto& d : i.cuda.devices) {
    j["devices"].push_back({{"index", d.index}, {"name", d.name}, {"total_bytes", d.total_bytes},
                            {"free_bytes", d.free_bytes}});
  }
  j["device_tier"] = i.cuda.devices.empty() ? "emulated" : "cuda";
  j["io_uring"] = {{"available", i.uring.available}, {"detail", i.uring.detail}, {"kernel", i.uring.kernel_release}};
  j["jemalloc"] = i.jemalloc;
  j["libtorch"] = i.libtorch;
  j["gloo"] = i.gloo;
  j["hwloc"] = i.topo.hwloc_version;
  fmt::print("{}\n", j.dump(2));
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Print the CPU, NUMA, SIMD, devices, io_uring and library versions strata sees");
  auto json = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json, "Print as JSON");
  cmd->callback([json] {
    const Info i = gather();
    if (*json) {
      print_json(i);
    } else {
      print_text(i);
    }
  });
}

}  // namespace strata::tools
