// `strata checkpoint`: an engine checkpoint offline, no training process
// needed (docs/checkpoint.md):
//   inspect DIR [--json]     the layout it was saved under, the step, its
//                            tensors with their pieces, and its files
//   verify DIR               every file against the manifest
//   export DIR --hf OUT      one-process weights in Hugging Face's layout:
//                            sharded safetensors files and
//                            model.safetensors.index.json, streamed
//   convert DIR --to-layout single --out OUT
//                            the whole training state as one part
//   convert DIR --like CKPT --out OUT
//                            ... in the layout another checkpoint was saved under
// LibTorch-free: it reads state.json through strata_checkpoint.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include <sys/resource.h>

#include "commands.h"
#include "strata/checkpoint/checkpoint_dir.h"
#include "strata/checkpoint/convert.h"
#include "strata/checkpoint/engine_state.h"
#include "strata/checkpoint/safetensors.h"
#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/kernels/optim.h"

namespace strata::tools {

namespace {

using checkpoint::CheckpointReader;
using checkpoint::PartMap;
using checkpoint::SafetensorsReader;
using checkpoint::SafetensorsWriter;
using json = nlohmann::json;

// This process's peak resident set (getrusage's ru_maxrss, in KiB on Linux).
uint64_t peak_rss_bytes() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<uint64_t>(u.ru_maxrss) * 1024;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void inspect(const std::string& dir, bool as_json) {
  const checkpoint::EngineCheckpoint c = checkpoint::open_engine_checkpoint(dir);
  const checkpoint::StateIndex& x = c.index;
  uint64_t bytes = 0;
  for (const auto& f : c.reader.manifest().files) bytes += f.bytes;
  int64_t total = 0;
  for (const auto& p : x.params) total += checkpoint::element_count(p.shape);
  if (as_json) {
    json params = json::array();
    for (const auto& p : x.params) {
      json pieces = json::array();
      for (const auto& piece : p.pieces) {
        pieces.push_back({{"part", piece.part}, {"elements", piece.map.part_elems()}, {"runs", piece.map.runs.size()},
                          {"file", checkpoint::part_file("master", piece.part, x.layout.parts())}});
      }
      params.push_back({{"name", p.name}, {"shape", p.shape}, {"steps", p.steps}, {"pieces", pieces}});
    }
    json files = json::array();
    for (const auto& f : c.reader.manifest().files) files.push_back({{"name", f.name}, {"bytes", f.bytes}});
    const json out = {{"dir", c.reader.dir()},
                      {"layout", {{"tensor", x.layout.tensor}, {"pipeline", x.layout.pipeline},
                                  {"data", x.layout.world}, {"zero_stage", x.layout.zero_stage},
                                  {"parts", x.layout.parts()}}},
                      {"precision", x.precision},
                      {"optimizer", x.optimizer},
                      {"states", x.states},
                      {"optimizer_steps", x.optimizer_steps},
                      {"micro_steps", c.state.value("micro_steps", 0)},
                      {"parameters", params},
                      {"elements", total},
                      {"files", files},
                      {"bytes", bytes}};
    fmt::print("{}\n", out.dump(1));
    return;
  }
  fmt::print("checkpoint {}: saved at {} ({} part{})\n", c.reader.dir(), x.layout.describe(), x.layout.parts(),
             x.layout.parts() == 1 ? "" : "s");
  fmt::print("  step: {} optimizer steps, {} micro-steps; optimizer {} ({}); precision {}\n", x.optimizer_steps,
             c.state.value("micro_steps", 0), x.optimizer, fmt::format("{}", fmt::join(x.states, ", ")), x.precision);
  fmt::print("  {} parameters, {} elements ({} of fp32 weights)\n", x.params.size(), total,
             format_bytes(static_cast<uint64_t>(total) * 4));
  fmt::print("  {} files, {}:\n", c.reader.manifest().files.size(), format_bytes(bytes));
  for (const auto& f : c.reader.manifest().files) fmt::print("    {:<40} {:>12}\n", f.name, format_bytes(f.bytes));
  fmt::print("  parameters (where each piece lives: the part whose files hold it):\n");
  for (const auto& p : x.params) {
    std::string where;
    for (const auto& piece : p.pieces) {
      where += fmt::format("{}part {}: {} elements in {} run{}", where.empty() ? "" : "; ", piece.part,
                           piece.map.part_elems(), piece.map.runs.size(), piece.map.runs.size() == 1 ? "" : "s");
    }
    fmt::print("    {:<32} {:<14} {}\n", p.name, shape_text(p.shape), where);
  }
}

void verify(const std::string& dir) {
  const CheckpointReader reader(dir);
  reader.verify();
  uint64_t bytes = 0;
  for (const auto& f : reader.manifest().files) bytes += f.bytes;
  fmt::print("{}: {} files, {}, every one of its size and checksum; peak RSS {}\n", reader.dir(),
             reader.manifest().files.size(), format_bytes(bytes), format_bytes(peak_rss_bytes()));
}

}  // namespace

// What the four subcommands read; the callbacks own it with the app (no leak at exit).
struct CheckpointOptions {
  std::string dir;
  bool json = false;
  std::string out;
  std::string shard = "5GB";
  std::string dtype = "fp32";
  std::string layout;
  std::string like;
};

void add_checkpoint_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("checkpoint", "inspect, verify or export an engine checkpoint, offline");
  cmd->require_subcommand(1);
  auto o = std::make_shared<CheckpointOptions>();

  CLI::App* ins = cmd->add_subcommand("inspect", "the layout, step, tensors and files of a checkpoint");
  ins->add_option("dir", o->dir, "checkpoint directory")->required();
  ins->add_flag("--json", o->json, "print JSON");
  ins->callback([o] { inspect(o->dir, o->json); });

  CLI::App* ver = cmd->add_subcommand("verify", "check every file of a checkpoint against its manifest");
  ver->add_option("dir", o->dir, "checkpoint (or exported weights) directory")->required();
  ver->callback([o] { verify(o->dir); });

  CLI::App* exp = cmd->add_subcommand("export", "one-process weights in Hugging Face's layout (sharded safetensors)");
  exp->add_option("dir", o->dir, "checkpoint directory")->required();
  exp->add_option("--hf", o->out, "output directory (replaced atomically; only an earlier export is replaced)")
      ->required();
  exp->add_option("--shard-size", o->shard, "the most bytes per shard file (e.g. 5GB, 512MiB)");
  exp->add_option("--dtype", o->dtype, "fp32, bf16 or fp16");
  exp->callback([o] {
    const checkpoint::ConvertStats st =
        checkpoint::export_hf(o->dir, o->out, parse_bytes(o->shard), parse_dtype(o->dtype));
    fmt::print("exported {} tensors of checkpoint {} ({}) to {}: {} shard{}, {} in {}, {:.1f} MB/s; peak RSS {}\n",
               st.tensors, o->dir, st.layout, o->out, st.files, st.files == 1 ? "" : "s", format_bytes(st.bytes),
               o->dtype, static_cast<double>(st.bytes) / 1e6 / std::max(st.seconds, 1e-9),
               format_bytes(peak_rss_bytes()));
  });

  CLI::App* con = cmd->add_subcommand("convert", "rewrite a checkpoint in another layout, streamed and atomic: one "
                                                 "part (--to-layout single), or another checkpoint's (--like)");
  con->add_option("dir", o->dir, "checkpoint directory")->required();
  con->add_option("--out", o->out, "the converted checkpoint's directory (replaced atomically)")->required();
  con->add_option("--to-layout", o->layout, "single: tp 1 x pp 1, whole tensors");
  con->add_option("--like", o->like, "a checkpoint of the same model under the layout wanted (its parts and cuts)");
  con->callback([o] {
    STRATA_CHECK(o->layout.empty() != o->like.empty(), "convert takes --to-layout single or --like CHECKPOINT (one "
                 "of them): a layout's cuts of each parameter are the model's, so another sharded layout comes from a "
                 "checkpoint saved under it (or train under it and --resume: a load reads any layout)");
    STRATA_CHECK(o->layout.empty() || o->layout == "single", "--to-layout ", o->layout, ": only \"single\" needs "
                 "no model; for another layout give --like a checkpoint saved under it");
    const checkpoint::ConvertStats st = o->like.empty() ? checkpoint::convert_single(o->dir, o->out)
                                                        : checkpoint::convert_like(o->dir, o->like, o->out);
    fmt::print("converted checkpoint {} ({}) to {} ({}): {} tensors, {} in {} tensor files, {:.1f} MB/s; peak RSS {}\n",
               o->dir, st.layout, o->out, o->like.empty() ? std::string("tp 1 x pp 1") : "the layout of " + o->like,
               st.tensors, format_bytes(st.bytes), st.files,
               static_cast<double>(st.bytes) / 1e6 / std::max(st.seconds, 1e-9), format_bytes(peak_rss_bytes()));
  });
}

}  // namespace strata::tools
