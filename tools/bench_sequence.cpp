// `strata bench sequence`: each sequence-parallel attention's activation
// memory and communication per rank at sp 1, 2 and 4, beside the expected
// scaling, and the longest context that fits a per-rank memory budget. Run
// under the launcher with 4 ranks (sp 1 and 2 use the first ranks):
//
//   strata run -n 4 -- strata bench sequence [--context 2048] [--budget 64MiB] [--json]
//
// One attention layer (batch 1, --heads heads of --head-dim), forward and
// backward, causal. Memory: the peak of the non-model bytes counter the
// tracer reads (every CPU tensor LibTorch allocates) during the layer, above
// its level before; the expected scaling from sp 1 is 1/N for ring attention
// (blocks of (S/N)^2 scores, O(S/N) the rest) and for Ulysses and ring
// self-attention the S^2/N scores. Communication: the bytes this rank sends
// through the sequence group during the layer, counted by a communicator
// wrapper (point to point: the payload; all-to-all: the N-1 blocks that
// leave the rank). Longest context: doubling from 256 positions until the
// peak passes --budget, then halving the step down to 1/16 of it.
#include <fmt/format.h>
#include <torch/torch.h>

#include <atomic>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "counting_communicator.h"
#include "strata/core/bytes.h"
#include "strata/core/dtype.h"
#include "strata/core/error.h"
#include "strata/parallel/communicator.h"
#include "strata/parallel/memory_counter.h"
#include "strata/parallel/sequence_parallel.h"

namespace strata::tools {
namespace {

using parallel::Communicator;

struct SequenceBenchOptions {
  int64_t context = 2048;
  int64_t heads = 4, head_dim = 32;
  std::string budget = "64MiB";
  bool json = false;
};

using parallel::sequence::Mode;
using parallel::sequence::mode_name;

struct Measured {
  uint64_t peak = 0;  // activation bytes above the level before
  uint64_t sent = 0;
};

// One causal attention layer, forward and backward, on this rank's S/N positions.
Measured measure_attention(Mode mode, CountingCommunicator& group, int64_t context, const SequenceBenchOptions& o) {
  const int64_t n = group.world_size(), s = context / n;
  torch::manual_seed(group.rank());
  auto& counter = parallel::cpu_non_model_counter();
  Measured m;
  {
    torch::Tensor q = torch::randn({1, o.heads, s, o.head_dim}).requires_grad_();
    torch::Tensor k = torch::randn({1, o.heads, s, o.head_dim}).requires_grad_();
    torch::Tensor v = torch::randn({1, o.heads, s, o.head_dim}).requires_grad_();
    const uint64_t before = counter.current();
    counter.reset_peak();
    group.take();
    parallel::sequence::AttentionOptions options;  // causal; ring attention in the zigzag layout
    options.mode = mode;
    parallel::sequence::Attention(group, options)->forward(q, k, v).sum().backward();
    m.peak = counter.peak() - std::min(counter.peak(), before);
    m.sent = group.take();
  }
  return m;
}

void run_sequence_bench(const SequenceBenchOptions& o) {
  auto world = parallel::make_gloo_communicator(parallel::Rendezvous::from_env());
  const int rank = world->rank();
  STRATA_CHECK(world->world_size() == 4, "strata bench sequence runs on 4 ranks (strata run -n 4), not ",
               world->world_size());
  STRATA_CHECK(o.context % 64 == 0 && o.context >= 64, "--context must be a multiple of 64");
  const uint64_t budget = parse_bytes(o.budget);
  // Groups of the first 1, 2 and 4 ranks.
  std::vector<std::unique_ptr<Communicator>> groups(3);
  const int sizes[] = {1, 2, 4};
  for (int i = 0; i < 3; ++i) {
    std::vector<int> members;
    for (int r = 0; r < sizes[i]; ++r) members.push_back(r);
    if (rank < sizes[i]) groups[i] = world->split(members, fmt::format("strata-bench-sp-{}", sizes[i]));
  }
  nlohmann::json rows = nlohmann::json::array();
  if (rank == 0 && !o.json) {
    fmt::print("strata bench sequence: causal attention, {} heads x {}, context {}, per rank; budget {} for the "
               "longest context\n",
               o.heads, o.head_dim, o.context, format_bytes(budget));
    fmt::print("{:<20} {:>3} {:>13} {:>9} {:>9} {:>13} {:>13} {:>9}\n", "mode", "sp", "activations", "vs sp 1",
               "expected", "sent/layer", "expected", "longest");
  }
  for (Mode mode : {Mode::kUlysses, Mode::kRingSelfAttention, Mode::kRingAttention}) {
    uint64_t base = 0;
    int64_t base_longest = 0;
    for (int i = 0; i < 3; ++i) {
      const int n = sizes[i];
      Measured at;
      int64_t longest = 0;
      if (rank < n) {
        CountingCommunicator group(*groups[i]);
        at = measure_attention(mode, group, o.context, o);
        // The longest context under the budget: doubling, then bisecting to 1/16 of the last step.
        const int64_t unit = 64;
        // Whether context `c` stays within the budget on every rank of the group.
        const auto within = [&](int64_t c) {
          const std::vector<double> all =
              parallel::all_gather_values(group, {static_cast<double>(measure_attention(mode, group, c, o).peak)});
          return *std::max_element(all.begin(), all.end()) <= static_cast<double>(budget);
        };
        int64_t fits = 0, fails = 0;
        for (int64_t c = 256; fails == 0 && c <= (int64_t{1} << 20); c *= 2) (within(c) ? fits : fails) = c;
        while (fails > 0 && fails - fits > std::max<int64_t>(unit, fits / 16)) {
          const int64_t mid = (fits + fails) / 2 / unit * unit;
          if (mid <= fits) break;
          (within(mid) ? fits : fails) = mid;
        }
        longest = fits;
      }
      if (rank == 0) {
        if (n == 1) {
          base = at.peak;
          base_longest = longest;
        }
        const double expected = 1.0 / n;
        // Bytes sent per layer, in units of one local q (B x H x S/N x D fp32):
        // Ulysses 8 all-to-alls of (N-1)/N; ring self-attention keys and values
        // N-1 hops each way; ring attention k and v N-1 hops forward, k, v and
        // their gradients N-1 hops and the gradients once more backward.
        const double local = static_cast<double>(o.heads) * (o.context / n) * o.head_dim * 4;
        const double units = mode == Mode::kUlysses             ? 8.0 * (n - 1) / n
                             : mode == Mode::kRingSelfAttention ? 4.0 * (n - 1)
                             : n > 1                            ? 6.0 * n - 4
                                                                : 0.0;
        const uint64_t expected_sent = static_cast<uint64_t>(units * local);
        const double ratio = base > 0 ? static_cast<double>(at.peak) / base : 0.0;
        if (o.json) {
          rows.push_back({{"mode", mode_name(mode)}, {"sp", n}, {"activation_bytes", at.peak},
                          {"vs_sp1", ratio}, {"expected", expected}, {"sent_bytes", at.sent},
                          {"expected_sent_bytes", expected_sent},
                          {"longest_context", longest},
                          {"longest_vs_sp1", base_longest > 0 ? static_cast<double>(longest) / base_longest : 0.0}});
        } else {
          fmt::print("{:<20} {:>3} {:>13} {:>9.3f} {:>9.3f} {:>13} {:>13} {:>9} ({:.2f}x)\n", mode_name(mode), n,
                     format_bytes(at.peak), ratio, expected, format_bytes(at.sent), format_bytes(expected_sent), longest,
                     base_longest > 0 ? static_cast<double>(longest) / base_longest : 0.0);
        }
      }
      world->barrier()->wait();
    }
  }
  if (rank == 0 && o.json) {
    fmt::print("{}\n", nlohmann::json{{"context", o.context}, {"heads", o.heads}, {"head_dim", o.head_dim},
                                       {"budget_bytes", budget}, {"rows", rows}}
                           .dump(1));
  }
  world->barrier()->wait();
}

}  // namespace

void add_bench_sequence_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("sequence",
                                   "Sequence-parallel attention: activations, bytes sent, longest context (strata run -n 4)");
  auto o = std::make_shared<SequenceBenchOptions>();
  cmd->add_option("--context", o->context, "positions for the memory and traffic rows (a multiple of 64)");
  cmd->add_option("--heads", o->heads, "attention heads (Ulysses needs a multiple of 4)");
  cmd->add_option("--head-dim", o->head_dim, "head width");
  cmd->add_option("--budget", o->budget, "per-rank activation budget for the longest context");
  cmd->add_flag("--json", o->json, "print one JSON document (rank 0)");
  cmd->callback([o] { run_sequence_bench(*o); });
}

}  // namespace strata::tools
