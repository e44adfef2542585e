// `strata checkpoint`: an engine checkpoint offline, no training process
// needed (docs/checkpoint.md):
//   inspect DIR [--json]     the layout it was saved under, the step, its
//                            tensors with their pieces, and its files
//   verify DIR               every file against the manifest
//   export DIR --hf OUT      one-process weights in Hugging Face's layout:
//                            sharded safetensors files and
//                            model.safetensors.index.json, streamed
// LibTorch-free: it reads state.json through strata_checkpoint.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "strata/checkpoint/checkpoint_dir.h"
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

int64_t elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

struct Opened {
  CheckpointReader reader;
  checkpoint::StateIndex index;
  json state;
};

Opened open_checkpoint(const std::string& dir) {
  CheckpointReader reader(dir);
  STRATA_CHECK(reader.manifest().kind == "strata-engine", dir, " is a \"", reader.manifest().kind,
               "\" directory, not an engine checkpoint (Engine::save, examples/gpt --checkpoint-dir)");
  json state;
  try {
    state = json::parse(reader.read_text("state.json"));
  } catch (const json::exception& e) {
    STRATA_FAIL(reader.path("state.json"), ": not JSON (", e.what(), ")");
  }
  checkpoint::StateIndex index = checkpoint::parse_state_index(state, reader.path("state.json"));
  return {std::move(reader), std::move(index), std::move(state)};
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void inspect(const std::string& dir, bool as_json) {
  const Opened c = open_checkpoint(dir);
  const checkpoint::StateIndex& x = c.index;
  uint64_t bytes = 0;
  for (const auto& f : c.reader.manifest().files) bytes += f.bytes;
  int64_t total = 0;
  for (const auto& p : x.params) total += elements(p.shape);
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
  fmt::print("{}: {} files, {}, every one of its size and checksum\n", reader.dir(), reader.manifest().files.size(),
             format_bytes(bytes));
}

// Note [Exporting a checkpoint in Hugging Face's layout]
// One process's weights from a checkpoint of any layout: each parameter's
// fp32 master values, assembled in the whole parameter's row-major order
// from the overlaps of its saved pieces (Note [Parts of a whole parameter]),
// cast to the dtype asked for and appended to the shard file it falls in,
// a block of at most 4 MiB at a time, so the export holds one block, never a
// whole tensor. Parameters go to shards in the checkpoint's order, a new
// shard whenever the next one would take the current one past the shard
// size (a parameter larger than it gets a shard of its own).
// model.safetensors.index.json maps each name to its shard, as
// transformers' sharded checkpoints do. The directory is built beside OUT
// and put in place atomically (Note [Atomic checkpoint directories]; its
// manifest.json lists every file with its checksum): a kill at any moment
// leaves the previous export or the complete new one, and a directory that
// is not an earlier export is never replaced.
void export_hf(const std::string& dir, const std::string& out, uint64_t shard_bytes, const std::string& dtype_name) {
  const auto t0 = std::chrono::steady_clock::now();
  const Opened c = open_checkpoint(dir);
  const checkpoint::StateIndex& x = c.index;
  STRATA_CHECK(shard_bytes > 0, "--shard-size must be more than 0");
  const DType dtype = parse_dtype(dtype_name);
  const std::string st_dtype = dtype == DType::kFloat32 ? "F32" : dtype == DType::kBFloat16 ? "BF16" : "F16";
  const size_t esize = dtype_size(dtype);
  const int parts = x.layout.parts();
  std::vector<std::string> masters;
  for (int k = 0; k < parts; ++k) masters.push_back(checkpoint::part_file("master", k, parts));
  c.reader.verify(masters);
  std::map<int, std::unique_ptr<SafetensorsReader>> files;
  for (int k = 0; k < parts; ++k) files[k] = std::make_unique<SafetensorsReader>(c.reader.path(masters[k]));

  // The shards, by size in the dtype asked for.
  std::vector<std::vector<size_t>> shards;
  uint64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < x.params.size(); ++i) {
    const uint64_t b = static_cast<uint64_t>(elements(x.params[i].shape)) * esize;
    if (shards.empty() || (in_shard > 0 && in_shard + b > shard_bytes)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += b;
    total += b;
  }
  auto shard_name = [&](size_t s) { return fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size()); };

  checkpoint::CheckpointWriter w(out, "hf-weights");
  json weight_map = json::object();
  std::vector<float> block;
  std::vector<char> cast;
  constexpr int64_t kBlock = 1 << 20;  // elements: 4 MiB of fp32
  for (size_t s = 0; s < shards.size(); ++s) {
    std::vector<SafetensorsWriter::Spec> specs;
    for (size_t i : shards[s]) specs.push_back({x.params[i].name, st_dtype, x.params[i].shape});
    SafetensorsWriter sw(w.path(shard_name(s)), specs, {{"format", "pt"}});
    for (size_t i : shards[s]) {
      const checkpoint::SavedParam& p = x.params[i];
      const int64_t n = elements(p.shape);
      const PartMap whole = PartMap::whole(p.shape);
      struct Take {
        int part;
        checkpoint::Overlap o;
      };
      std::vector<Take> takes;
      for (const auto& piece : p.pieces) {
        for (const checkpoint::Overlap& o : checkpoint::overlaps(whole, 0, n, piece.map)) takes.push_back({piece.part, o});
      }
      std::sort(takes.begin(), takes.end(), [](const Take& a, const Take& b) { return a.o.dst < b.o.dst; });
      int64_t at = 0;
      for (const Take& t : takes) {
        if (t.o.dst + t.o.length <= at) continue;  // a copy another piece gave already
        STRATA_CHECK(t.o.dst == at, dir, ": parameter ", p.name, " has no saved piece holding its element ", at,
                     "; the checkpoint is incomplete");
        const SafetensorsReader& r = *files.at(t.part);
        const checkpoint::TensorEntry* e = r.header().find(p.name);
        STRATA_CHECK(e != nullptr && e->dtype == "F32", r.path(), " has no fp32 tensor ", p.name);
        for (int64_t done = 0; done < t.o.length; done += kBlock) {
          const int64_t m = std::min(kBlock, t.o.length - done);
          block.resize(static_cast<size_t>(m));
          r.read(*e, static_cast<uint64_t>(t.o.src + done) * sizeof(float), block.data(), static_cast<size_t>(m) * 4);
          if (dtype == DType::kFloat32) {
            sw.append(block.data(), static_cast<size_t>(m) * 4);
          } else {
            cast.resize(static_cast<size_t>(m) * esize);
            kernels::cast(block.data(), DType::kFloat32, cast.data(), dtype, m);
            sw.append(cast.data(), cast.size());
          }
        }
        at = t.o.dst + t.o.length;
      }
      STRATA_CHECK(at == n, dir, ": parameter ", p.name, " has no saved piece holding its element ", at,
                   "; the checkpoint is incomplete");
      weight_map[p.name] = shard_name(s);
    }
    sw.finish();
    w.add(shard_name(s), sw.bytes(), sw.checksum());
  }
  const json index = {{"metadata", {{"total_size", total}, {"format", "pt"}}}, {"weight_map", weight_map}};
  w.write_text("model.safetensors.index.json", index.dump(2) + "\n");
  w.commit();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("exported {} tensors of checkpoint {} ({}) to {}: {} shard{}, {} in {}, {:.1f} MB/s\n", x.params.size(),
             c.reader.dir(), x.layout.describe(), out, shards.size(), shards.size() == 1 ? "" : "s", format_bytes(total),
             dtype_name, static_cast<double>(total) / 1e6 / std::max(seconds, 1e-9));
}

}  // namespace

void add_checkpoint_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("checkpoint", "inspect, verify or export an engine checkpoint, offline");
  cmd->require_subcommand(1);

  CLI::App* ins = cmd->add_subcommand("inspect", "the layout, step, tensors and files of a checkpoint");
  auto* dir = new std::string;
  auto* as_json = new bool(false);
  ins->add_option("dir", *dir, "checkpoint directory")->required();
  ins->add_flag("--json", *as_json, "print JSON");
  ins->callback([dir, as_json] { inspect(*dir, *as_json); });

  CLI::App* ver = cmd->add_subcommand("verify", "check every file of a checkpoint against its manifest");
  auto* vdir = new std::string;
  ver->add_option("dir", *vdir, "checkpoint (or exported weights) directory")->required();
  ver->callback([vdir] { verify(*vdir); });

  CLI::App* exp = cmd->add_subcommand("export", "one-process weights in Hugging Face's layout (sharded safetensors)");
  auto* edir = new std::string;
  auto* out = new std::string;
  auto* shard = new std::string("5GB");
  auto* dtype = new std::string("fp32");
  exp->add_option("dir", *edir, "checkpoint directory")->required();
  exp->add_option("--hf", *out, "output directory (replaced atomically; only an earlier export is replaced)")
      ->required();
  exp->add_option("--shard-size", *shard, "the most bytes per shard file (e.g. 5GB, 512MiB)");
  exp->add_option("--dtype", *dtype, "fp32, bf16 or fp16");
  exp->callback([edir, out, shard, dtype] { export_hf(*edir, *out, parse_bytes(*shard), *dtype); });
}

}  // namespace strata::tools
