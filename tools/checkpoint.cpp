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
  fmt::print("{}: {} files, {}, every one of its size and checksum; peak RSS {}\n", reader.dir(),
             reader.manifest().files.size(), format_bytes(bytes), format_bytes(peak_rss_bytes()));
}

// The readers of tensor file `stem` of every part, verified first.
std::map<int, std::unique_ptr<SafetensorsReader>> open_parts(const Opened& c, const std::string& stem) {
  const int parts = c.index.layout.parts();
  std::vector<std::string> names;
  for (int k = 0; k < parts; ++k) names.push_back(checkpoint::part_file(stem, k, parts));
  c.reader.verify(names);
  std::map<int, std::unique_ptr<SafetensorsReader>> files;
  for (int k = 0; k < parts; ++k) files[k] = std::make_unique<SafetensorsReader>(c.reader.path(names[k]));
  return files;
}

// Parameter `p`'s elements in the whole's row-major order, from its saved
// pieces in `files`, to `sink(data, elements, dtype)` a block of at most 1 Mi
// elements at a time (Note [Parts of a whole parameter]).
template <typename Sink>
void stream_whole(const std::map<int, std::unique_ptr<SafetensorsReader>>& files, const checkpoint::SavedParam& p,
                  const std::string& dir, std::vector<char>& block, Sink sink) {
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
  constexpr int64_t kBlock = 1 << 20;
  int64_t at = 0;
  for (const Take& t : takes) {
    if (t.o.dst + t.o.length <= at) continue;  // a copy another piece gave already
    STRATA_CHECK(t.o.dst == at, dir, ": parameter ", p.name, " has no saved piece holding its element ", at,
                 "; the checkpoint is incomplete");
    const SafetensorsReader& r = *files.at(t.part);
    const checkpoint::TensorEntry* e = r.header().find(p.name);
    STRATA_CHECK(e != nullptr && static_cast<int64_t>(e->numel()) >= t.o.src + t.o.length, r.path(),
                 " has no tensor ", p.name, " of the size its pieces say");
    const size_t esize = checkpoint::dtype_bytes(e->dtype);
    for (int64_t done = 0; done < t.o.length; done += kBlock) {
      const int64_t m = std::min(kBlock, t.o.length - done);
      block.resize(static_cast<size_t>(m) * esize);
      r.read(*e, static_cast<uint64_t>(t.o.src + done) * esize, block.data(), block.size());
      sink(block.data(), m, e->dtype);
    }
    at = t.o.dst + t.o.length;
  }
  STRATA_CHECK(at == n, dir, ": parameter ", p.name, " has no saved piece holding its element ", at,
               "; the checkpoint is incomplete");
}

}  // namespace

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
ExportStats export_hf(const std::string& dir, const std::string& out, uint64_t shard_bytes,
                      const std::string& dtype_name) {
  const auto t0 = std::chrono::steady_clock::now();
  const Opened c = open_checkpoint(dir);
  const checkpoint::StateIndex& x = c.index;
  STRATA_CHECK(shard_bytes > 0, "--shard-size must be more than 0");
  const DType dtype = parse_dtype(dtype_name);
  const std::string st_dtype = dtype == DType::kFloat32 ? "F32" : dtype == DType::kBFloat16 ? "BF16" : "F16";
  const size_t esize = dtype_size(dtype);
  const auto files = open_parts(c, "master");

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
  std::vector<char> block, cast;
  for (size_t s = 0; s < shards.size(); ++s) {
    std::vector<SafetensorsWriter::Spec> specs;
    for (size_t i : shards[s]) specs.push_back({x.params[i].name, st_dtype, x.params[i].shape});
    SafetensorsWriter sw(w.path(shard_name(s)), specs, {{"format", "pt"}});
    for (size_t i : shards[s]) {
      stream_whole(files, x.params[i], c.reader.dir(), block, [&](const char* data, int64_t m, const std::string& st) {
        STRATA_CHECK(st == "F32", c.reader.dir(), ": parameter ", x.params[i].name, "'s master is ", st, ", not F32");
        if (dtype == DType::kFloat32) {
          sw.append(data, static_cast<size_t>(m) * 4);
          return;
        }
        cast.resize(static_cast<size_t>(m) * esize);
        kernels::cast(data, DType::kFloat32, cast.data(), dtype, m);
        sw.append(cast.data(), cast.size());
      });
      weight_map[x.params[i].name] = shard_name(s);
    }
    sw.finish();
    w.add(shard_name(s), sw.bytes(), sw.checksum());
  }
  const json index = {{"metadata", {{"total_size", total}, {"format", "pt"}}}, {"weight_map", weight_map}};
  w.write_text("model.safetensors.index.json", index.dump(2) + "\n");
  w.commit();
  ExportStats st;
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.bytes = total;
  st.files = shards.size();
  st.tensors = x.params.size();
  st.layout = x.layout.describe();
  return st;
}

// Note [Converting a checkpoint]
// `convert --to-layout single` merges a checkpoint of any layout into one
// part (tp 1 x pp 1): each tensor file (the fp32 masters, every optimizer
// state, the compute copy and gradients when saved) with whole tensors,
// streamed as the export streams them; the module state files into one; the
// first part's RNG states; state.json with the layout and pieces dropped.
// Any layout loads either form (Note [Checkpoints across layouts]), so this
// is for tools that want whole tensors, or one writer's files; other target
// layouts need the model's own cuts, which only a training process has:
// load the checkpoint there instead. Atomic, as the export.
ExportStats convert_single(const std::string& dir, const std::string& out) {
  const auto t0 = std::chrono::steady_clock::now();
  const Opened c = open_checkpoint(dir);
  const checkpoint::StateIndex& x = c.index;
  const int parts = x.layout.parts();
  for (const auto& p : x.params) {
    STRATA_CHECK(p.name.find("@tensor") == std::string::npos, dir, ": parameter ", p.name, " was split by a layer "
                 "that said not where its part lies (mark_split without a part map); it cannot be merged");
  }
  std::vector<std::string> stems = {"master"};
  for (const std::string& st : x.states) stems.push_back(st);
  for (const char* optional : {"param", "grad"}) {
    if (c.reader.has(checkpoint::part_file(optional, 0, parts))) stems.push_back(optional);
  }
  checkpoint::CheckpointWriter w(out, "strata-engine");
  ExportStats st;
  std::vector<char> block;
  for (const std::string& stem : stems) {
    const auto files = open_parts(c, stem);
    std::vector<SafetensorsWriter::Spec> specs;
    for (const auto& p : x.params) {
      const checkpoint::TensorEntry* e = files.at(p.pieces.front().part)->header().find(p.name);
      STRATA_CHECK(e != nullptr, files.at(p.pieces.front().part)->path(), " has no tensor ", p.name);
      specs.push_back({p.name, e->dtype, p.shape});
    }
    const std::string name = checkpoint::part_file(stem, 0, 1);
    SafetensorsWriter sw(w.path(name), specs, stem == "master" ? std::map<std::string, std::string>{{"format", "pt"}}
                                                               : std::map<std::string, std::string>{});
    for (const auto& p : x.params) {
      stream_whole(files, p, c.reader.dir(), block, [&](const char* data, int64_t m, const std::string& dt) {
        sw.append(data, static_cast<size_t>(m) * checkpoint::dtype_bytes(dt));
      });
    }
    sw.finish();
    w.add(name, sw.bytes(), sw.checksum());
    st.bytes += sw.bytes();
    ++st.files;
  }
  // Buffers and frozen parameters: every name once, from the first file holding it.
  json module_state = json::array();
  if (!x.module_state_files.empty()) {
    c.reader.verify(x.module_state_files);
    std::vector<std::unique_ptr<SafetensorsReader>> readers;
    std::vector<std::pair<const SafetensorsReader*, const checkpoint::TensorEntry*>> take;
    std::set<std::string> seen;
    for (const std::string& f : x.module_state_files) {
      readers.push_back(std::make_unique<SafetensorsReader>(c.reader.path(f)));
      for (const auto& e : readers.back()->header().tensors) {
        if (seen.insert(e.name).second) take.push_back({readers.back().get(), &e});
      }
    }
    std::vector<SafetensorsWriter::Spec> specs;
    for (const auto& [r, e] : take) specs.push_back({e->name, e->dtype, e->shape});
    SafetensorsWriter sw(w.path("module_state.safetensors"), specs);
    for (const auto& [r, e] : take) {
      block.resize(e->end - e->begin);
      r->read(*e, 0, block.data(), block.size());
      sw.append(block.data(), block.size());
    }
    sw.finish();
    w.add("module_state.safetensors", sw.bytes(), sw.checksum());
    module_state.push_back("module_state.safetensors");
  }
  // The first part's RNG states, under one part's names.
  json rng = json::array();
  const std::string first = parts == 1 ? "" : ".part0";
  for (const std::string& f : x.rng_files) {
    const size_t at = f.find(first);
    if (parts > 1 && (at == std::string::npos || (f.compare(at + first.size(), 1, ".") != 0))) continue;
    const std::string renamed = parts == 1 ? f : f.substr(0, at) + f.substr(at + first.size());
    w.write_text(renamed, c.reader.read_text(f));
    rng.push_back(renamed);
  }
  json state = c.state;
  state["layout"] = {{"tensor", 1}, {"pipeline", 1}};
  state["rng"] = rng;
  state["module_state"] = module_state;
  for (json& p : state["parameters"]) p.erase("pieces");
  w.write_text("state.json", state.dump(1) + "\n");
  w.commit();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.tensors = x.params.size();
  st.layout = x.layout.describe();
  return st;
}

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
  exp->callback([edir, out, shard, dtype] {
    const ExportStats st = export_hf(*edir, *out, parse_bytes(*shard), *dtype);
    fmt::print("exported {} tensors of checkpoint {} ({}) to {}: {} shard{}, {} in {}, {:.1f} MB/s; peak RSS {}\n",
               st.tensors, *edir, st.layout, *out, st.files, st.files == 1 ? "" : "s", format_bytes(st.bytes), *dtype,
               static_cast<double>(st.bytes) / 1e6 / std::max(st.seconds, 1e-9), format_bytes(peak_rss_bytes()));
  });

  CLI::App* con = cmd->add_subcommand("convert", "rewrite a checkpoint in another layout (single: one part, whole "
                                                 "tensors), streamed and atomic");
  auto* cdir = new std::string;
  auto* cout = new std::string;
  auto* layout = new std::string;
  con->add_option("dir", *cdir, "checkpoint directory")->required();
  con->add_option("--out", *cout, "the converted checkpoint's directory (replaced atomically)")->required();
  con->add_option("--to-layout", *layout, "single (tp 1 x pp 1; any layout loads it, as it loads the original)")
      ->required();
  con->callback([cdir, cout, layout] {
    STRATA_CHECK(*layout == "single", "--to-layout ", *layout, ": only \"single\" is offline; a checkpoint loads "
                 "under any other layout as it is (Engine::load reads each rank's part), so train under the new layout "
                 "and --resume from it");
    const ExportStats st = convert_single(*cdir, *cout);
    fmt::print("converted checkpoint {} ({}) to {} (tp 1 x pp 1): {} tensors, {} in {} tensor files, {:.1f} MB/s; "
               "peak RSS {}\n", *cdir, st.layout, *cout, st.tensors, format_bytes(st.bytes), st.files,
               static_cast<double>(st.bytes) / 1e6 / std::max(st.seconds, 1e-9), format_bytes(peak_rss_bytes()));
  });
}

}  // namespace strata::tools
