// `strata bench comm`: collective throughput on the active backend, swept
// over sizes in the manner of nccl-tests, run under the launcher:
//
//   strata run -n 2 -- strata bench comm [--min 1KiB] [--max 64MiB] [--iters 5] [--json]
//
// For each collective and size: the median time of --iters runs (after one
// warm-up), algbw = bytes / time and busbw = algbw x the collective's factor
// (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
// broadcast 1), as nccl-tests defines them. Rank 0 prints, beside a memcpy
// ceiling measured in the same run (loopback TCP moves bytes through memory).
#include <fmt/format.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench_timing.h"
#include "commands.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/parallel/communicator.h"

namespace strata::tools {
namespace {

struct CommBenchOptions {
  std::string min = "1KiB", max = "64MiB";
  int iters = 5;
  bool json = false;
};

void run_comm_bench(const CommBenchOptions& o) {
  STRATA_CHECK(o.iters >= 1, "--iters must be at least 1");
  auto comm = parallel::make_gloo_communicator(parallel::Rendezvous::from_env());
  const int n = comm->world_size();
  const uint64_t lo = parse_bytes(o.min), hi = parse_bytes(o.max);
  STRATA_CHECK(lo >= 4 && lo <= hi, "--min must be at least 4 bytes and at most --max");
  // The ceiling: one memcpy of the largest size, in this process.
  std::vector<char> a(hi, 1), b(hi, 0);
  const double memcpy_gbps = static_cast<double>(hi) / median([&] {
    std::vector<double> t;
    for (int i = 0; i < 3; ++i) t.push_back(seconds([&] { std::memcpy(b.data(), a.data(), hi); }));
    return t;
  }()) / 1e9;
  const double nn = n;
  struct Coll {
    const char* name;
    double factor;
  };
  const Coll colls[] = {{"all_reduce", 2 * (nn - 1) / nn}, {"all_gather", (nn - 1) / nn},
                        {"reduce_scatter", (nn - 1) / nn}, {"broadcast", 1.0}, {"all_to_all", (nn - 1) / nn}};
  nlohmann::json rows = nlohmann::json::array();
  if (comm->rank() == 0 && !o.json) {
    fmt::print("strata bench comm: {} ranks, backend {}, median of {}; memcpy ceiling {:.2f} GB/s\n", n,
               comm->backend(), o.iters, memcpy_gbps);
    fmt::print("{:<15} {:>12} {:>10} {:>12} {:>12}\n", "collective", "size", "time us", "algbw GB/s", "busbw GB/s");
  }
  for (const Coll& c : colls) {
    for (uint64_t bytes = lo; bytes <= hi; bytes *= 4) {
      // fp32 elements. As in nccl-tests, "size" is the whole buffer: all_reduce's
      // and broadcast's, all_gather's output, reduce_scatter's and all_to_all's input.
      const size_t count = bytes / 4;
      std::vector<float> in(count * n, 1.0f), out(count * n, 0.0f);
      auto once = [&] {
        const std::string name = c.name;
        if (name == "all_reduce") comm->all_reduce(in.data(), count, DType::kFloat32)->wait();
        if (name == "all_gather") comm->all_gather(in.data(), out.data(), count / n, DType::kFloat32)->wait();
        if (name == "reduce_scatter") comm->reduce_scatter(in.data(), out.data(), count / n, DType::kFloat32)->wait();
        if (name == "broadcast") comm->broadcast(in.data(), count, DType::kFloat32, 0)->wait();
        if (name == "all_to_all") comm->all_to_all(in.data(), out.data(), count / n, DType::kFloat32)->wait();
      };
      once();
      std::vector<double> t;
      for (int i = 0; i < o.iters; ++i) {
        comm->barrier()->wait();
        t.push_back(seconds(once));
      }
      const double s = median(t);
      const double algbw = static_cast<double>(bytes) / s / 1e9;
      if (comm->rank() == 0) {
        if (o.json) {
          rows.push_back({{"collective", c.name}, {"bytes", bytes}, {"us", s * 1e6}, {"algbw_gbps", algbw},
                          {"busbw_gbps", algbw * c.factor}});
        } else {
          fmt::print("{:<15} {:>12} {:>10.1f} {:>12.3f} {:>12.3f}\n", c.name, format_bytes(bytes), s * 1e6, algbw,
                     algbw * c.factor);
        }
      }
    }
  }
  if (comm->rank() == 0 && o.json) {
    fmt::print("{}\n", nlohmann::json{{"ranks", n}, {"backend", comm->backend()}, {"memcpy_gbps", memcpy_gbps},
                                       {"rows", rows}}
                           .dump(1));
  }
  comm->barrier()->wait();
}

}  // namespace

void add_bench_comm_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("comm", "Collective algbw/busbw over sizes (run it under strata run -n N)");
  auto o = std::make_shared<CommBenchOptions>();
  cmd->add_option("--min", o->min, "smallest per-rank buffer");
  cmd->add_option("--max", o->max, "largest per-rank buffer (sizes go up 4x)");
  cmd->add_option("--iters", o->iters, "timed runs per size (median reported)");
  cmd->add_flag("--json", o->json, "print one JSON document (rank 0)");
  cmd->callback([o] { run_comm_bench(*o); });
}

}  // namespace strata::tools
