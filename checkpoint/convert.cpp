// Offline conversions of an engine checkpoint: export in Hugging Face's
// layout and the merge into one part (convert.h).
#include "strata/checkpoint/convert.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <set>

#include "strata/checkpoint/checkpoint_dir.h"
#include "strata/checkpoint/safetensors.h"
#include "strata/core/error.h"
#include "strata/kernels/optim.h"

namespace strata::checkpoint {

using json = nlohmann::json;

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}


EngineCheckpoint open_engine_checkpoint(const std::string& dir) {
  CheckpointReader reader(dir);
  STRATA_CHECK(reader.manifest().kind == "strata-engine", dir, " is a \"", reader.manifest().kind,
               "\" directory, not an engine checkpoint (Engine::save, examples/gpt --checkpoint-dir)");
  json state;
  try {
    state = json::parse(reader.read_text("state.json"));
  } catch (const json::exception& e) {
    STRATA_FAIL(reader.path("state.json"), ": not JSON (", e.what(), ")");
  }
  StateIndex index = parse_state_index(state, reader.path("state.json"));
  return {std::move(reader), std::move(index), std::move(state)};
}

namespace {

// The readers of tensor file `stem` of every part, verified first.
std::map<int, std::unique_ptr<SafetensorsReader>> open_parts(const EngineCheckpoint& c, const std::string& stem) {
  const int parts = c.index.layout.parts();
  std::vector<std::string> names;
  for (int k = 0; k < parts; ++k) names.push_back(part_file(stem, k, parts));
  c.reader.verify(names);
  std::map<int, std::unique_ptr<SafetensorsReader>> files;
  for (int k = 0; k < parts; ++k) files[k] = std::make_unique<SafetensorsReader>(c.reader.path(names[k]));
  return files;
}

// The elements of parameter `p` that part map `want` holds, in its order
// (the whole's row-major order for PartMap::whole), from its saved pieces in `files`, to `sink(data, elements, dtype)` a block of at most 1 Mi
// elements at a time (Note [Parts of a whole parameter]).
template <typename Sink>
void stream_part(const std::map<int, std::unique_ptr<SafetensorsReader>>& files, const SavedParam& p,
                 const PartMap& want, const std::string& dir, std::vector<char>& block, Sink sink) {
  const int64_t n = want.part_elems();
  const PartMap& whole = want;
  struct Take {
    int part;
    Overlap o;
  };
  std::vector<Take> takes;
  for (const auto& piece : p.pieces) {
    for (const Overlap& o : overlaps(whole, 0, n, piece.map)) takes.push_back({piece.part, o});
  }
  std::sort(takes.begin(), takes.end(), [](const Take& a, const Take& b) { return a.o.dst < b.o.dst; });
  constexpr int64_t kBlock = 1 << 20;
  int64_t at = 0;
  for (const Take& t : takes) {
    if (t.o.dst + t.o.length <= at) continue;  // a copy another piece gave already
    STRATA_CHECK(t.o.dst == at, dir, ": parameter ", p.name, " has no saved piece holding its element ", at,
                 "; the checkpoint is incomplete");
    const SafetensorsReader& r = *files.at(t.part);
    const TensorEntry* e = r.header().find(p.name);
    STRATA_CHECK(e != nullptr && static_cast<int64_t>(e->numel()) >= t.o.src + t.o.length, r.path(),
                 " has no tensor ", p.name, " of the size its pieces say");
    const size_t esize = dtype_bytes(e->dtype);
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

// Output tensor file `name` (of tensor file `stem`): for each spec, the
// elements `want` gives of its saved parameter, streamed from `files`.
void write_recut(CheckpointWriter& w, const std::string& name, const std::string& stem,
                 const std::vector<SafetensorsWriter::Spec>& specs,
                 const std::vector<std::pair<const SavedParam*, const PartMap*>>& want,
                 const std::map<int, std::unique_ptr<SafetensorsReader>>& files, const std::string& dir,
                 std::vector<char>& block, ConvertStats& st) {
  SafetensorsWriter sw(w.path(name), specs, stem == "master" ? std::map<std::string, std::string>{{"format", "pt"}}
                                                             : std::map<std::string, std::string>{});
  for (const auto& [from, map] : want) {
    stream_part(files, *from, *map, dir, block, [&](const char* data, int64_t m, const std::string& dt) {
      sw.append(data, static_cast<size_t>(m) * dtype_bytes(dt));
    });
  }
  sw.finish();
  w.add(name, sw.bytes(), sw.checksum());
  st.bytes += sw.bytes();
  ++st.files;
}

// The first part's RNG states of `c`, written under the names part 0 of
// `to_parts` gives them (a rank of another layout takes those).
json first_part_rng(const EngineCheckpoint& c, int to_parts, CheckpointWriter& w) {
  const int parts = c.index.layout.parts();
  const std::string first = parts == 1 ? "" : ".part0";
  json rng = json::array();
  for (const std::string& f : c.index.rng_files) {
    const size_t at = f.find(first);
    if (parts > 1 && (at == std::string::npos || f.compare(at + first.size(), 1, ".") != 0)) continue;
    const std::string one = parts == 1 ? f : f.substr(0, at) + f.substr(at + first.size());  // rng_cpu[.rank<R>].bin
    const size_t dot = one.find('.');
    const std::string renamed = to_parts == 1 ? one : one.substr(0, dot) + ".part0" + one.substr(dot);
    w.write_text(renamed, c.reader.read_text(f));
    rng.push_back(renamed);
  }
  return rng;
}

// state.json written, the directory committed, the figures filled in.
ConvertStats commit(CheckpointWriter& w, const json& state, ConvertStats st, const StateIndex& x,
                    std::chrono::steady_clock::time_point t0) {
  w.write_text("state.json", state.dump(1) + "\n");
  w.commit();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.tensors = x.params.size();
  st.layout = x.layout.describe();
  return st;
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
ConvertStats export_hf(const std::string& dir, const std::string& out, uint64_t shard_bytes, DType dtype) {
  const auto t0 = std::chrono::steady_clock::now();
  const EngineCheckpoint c = open_engine_checkpoint(dir);
  const StateIndex& x = c.index;
  STRATA_CHECK(shard_bytes > 0, "--shard-size must be more than 0");
  const std::string st_dtype = dtype == DType::kFloat32 ? "F32" : dtype == DType::kBFloat16 ? "BF16" : "F16";
  const size_t esize = dtype_size(dtype);
  const auto files = open_parts(c, "master");

  // The shards, by size in the dtype asked for.
  std::vector<std::vector<size_t>> shards;
  uint64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < x.params.size(); ++i) {
    const uint64_t b = static_cast<uint64_t>(element_count(x.params[i].shape)) * esize;
    if (shards.empty() || (in_shard > 0 && in_shard + b > shard_bytes)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += b;
    total += b;
  }
  // Buffers and frozen parameters (each name once, as saved) go in one more
  // shard: known before any is written, since every shard's name says the count.
  std::vector<std::unique_ptr<SafetensorsReader>> readers;
  std::vector<std::pair<const SafetensorsReader*, const TensorEntry*>> take;
  if (!x.module_state_files.empty()) {
    c.reader.verify(x.module_state_files);
    std::set<std::string> seen;
    for (const auto& p : x.params) seen.insert(p.name);
    for (const std::string& f : x.module_state_files) {
      readers.push_back(std::make_unique<SafetensorsReader>(c.reader.path(f)));
      for (const auto& e : readers.back()->header().tensors) {
        if (seen.insert(e.name).second) take.push_back({readers.back().get(), &e});
      }
    }
  }
  const size_t count = shards.size() + (take.empty() ? 0 : 1);
  auto shard_name = [&](size_t s) { return fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, count); };

  CheckpointWriter w(out, "hf-weights");
  json weight_map = json::object();
  std::vector<char> block, cast;
  for (size_t s = 0; s < shards.size(); ++s) {
    std::vector<SafetensorsWriter::Spec> specs;
    for (size_t i : shards[s]) specs.push_back({x.params[i].name, st_dtype, x.params[i].shape});
    SafetensorsWriter sw(w.path(shard_name(s)), specs, {{"format", "pt"}});
    for (size_t i : shards[s]) {
      stream_part(files, x.params[i], PartMap::whole(x.params[i].shape), c.reader.dir(), block, [&](const char* data, int64_t m, const std::string& st) {
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
  if (!take.empty()) {
    const std::string name = shard_name(count - 1);
    std::vector<SafetensorsWriter::Spec> specs;
    for (const auto& [r, e] : take) specs.push_back({e->name, e->dtype, e->shape});
    SafetensorsWriter sw(w.path(name), specs, {{"format", "pt"}});
    for (const auto& [r, e] : take) {
      block.resize(e->end - e->begin);
      r->read(*e, 0, block.data(), block.size());
      sw.append(block.data(), block.size());
      weight_map[e->name] = name;
      total += e->end - e->begin;
    }
    sw.finish();
    w.add(name, sw.bytes(), sw.checksum());
  }
  const json index = {{"metadata", {{"total_size", total}, {"format", "pt"}}}, {"weight_map", weight_map}};
  w.write_text("model.safetensors.index.json", index.dump(2) + "\n");
  w.commit();
  ConvertStats st;
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.bytes = total;
  st.files = count;
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
ConvertStats convert_single(const std::string& dir, const std::string& out) {
  const auto t0 = std::chrono::steady_clock::now();
  const EngineCheckpoint c = open_engine_checkpoint(dir);
  const StateIndex& x = c.index;
  const int parts = x.layout.parts();
  for (const auto& p : x.params) {
    STRATA_CHECK(p.name.find("@tensor") == std::string::npos, dir, ": parameter ", p.name, " was split by a layer "
                 "that said not where its part lies (mark_split without a part map); it cannot be merged");
  }
  std::vector<std::string> stems = {"master"};
  for (const std::string& st : x.states) stems.push_back(st);
  for (const char* optional : {"param", "grad"}) {
    if (c.reader.has(part_file(optional, 0, parts))) stems.push_back(optional);
  }
  CheckpointWriter w(out, "strata-engine");
  ConvertStats st;
  std::vector<char> block;
  for (const std::string& stem : stems) {
    const auto files = open_parts(c, stem);
    std::vector<SafetensorsWriter::Spec> specs;
    for (const auto& p : x.params) {
      const TensorEntry* e = files.at(p.pieces.front().part)->header().find(p.name);
      STRATA_CHECK(e != nullptr, files.at(p.pieces.front().part)->path(), " has no tensor ", p.name);
      specs.push_back({p.name, e->dtype, p.shape});
    }
    std::vector<PartMap> wholes;
    for (const auto& p : x.params) wholes.push_back(PartMap::whole(p.shape));
    std::vector<std::pair<const SavedParam*, const PartMap*>> want;
    for (size_t i = 0; i < x.params.size(); ++i) want.push_back({&x.params[i], &wholes[i]});
    write_recut(w, part_file(stem, 0, 1), stem, specs, want, files, c.reader.dir(), block, st);
  }
  // Buffers and frozen parameters: every name once, from the first file holding it.
  json module_state = json::array();
  if (!x.module_state_files.empty()) {
    c.reader.verify(x.module_state_files);
    std::vector<std::unique_ptr<SafetensorsReader>> readers;
    std::vector<std::pair<const SafetensorsReader*, const TensorEntry*>> take;
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
  const json rng = first_part_rng(c, 1, w);
  json state = c.state;
  state["layout"] = {{"tensor", 1}, {"pipeline", 1}};
  state["rng"] = rng;
  state["module_state"] = module_state;
  for (json& p : state["parameters"]) p.erase("pieces");
  return commit(w, state, st, x, t0);
}

// Note [Converting a checkpoint] (to another checkpoint's layout): every
// tensor file of `dir` re-cut into the parts and pieces of `like`, a
// checkpoint of the same model saved under the layout wanted (its part maps
// are the model's own cuts, which only a training process knows): each of
// like's pieces gets the overlaps of its map with dir's pieces, streamed;
// state.json is dir's with like's layout and pieces; the module state
// files and dir's first part's RNG states go to part 0 (a rank of another
// layout takes those).
ConvertStats convert_like(const std::string& dir, const std::string& like, const std::string& out) {
  const auto t0 = std::chrono::steady_clock::now();
  const EngineCheckpoint c = open_engine_checkpoint(dir);
  const EngineCheckpoint t = open_engine_checkpoint(like);
  const StateIndex& x = c.index;
  const int parts = x.layout.parts(), to_parts = t.index.layout.parts();
  std::map<std::string, const SavedParam*> source;
  for (const auto& p : x.params) source[p.name] = &p;
  std::vector<std::string> problems;
  for (const auto& p : t.index.params) {
    const auto it = source.find(p.name);
    if (it == source.end()) {
      problems.push_back("parameter " + p.name + " of " + like + " is not in " + dir);
    } else if (it->second->shape != p.shape) {
      problems.push_back("parameter " + p.name + " differs in shape");
    }
  }
  if (t.index.params.size() != x.params.size()) problems.push_back("the two hold different parameters");
  STRATA_CHECK(problems.empty(), dir, " (", x.layout.describe(), ") and ", like, " (", t.index.layout.describe(),
               ") are not checkpoints of one model: ", problems.front());
  std::vector<std::string> stems = {"master"};
  for (const std::string& st : x.states) stems.push_back(st);
  for (const char* optional : {"param", "grad"}) {
    if (c.reader.has(part_file(optional, 0, parts))) stems.push_back(optional);
  }
  const auto shapes = open_parts(t, "master");  // the pieces' own shapes, as like's ranks hold them
  CheckpointWriter w(out, "strata-engine");
  ConvertStats st;
  std::vector<char> block;
  for (const std::string& stem : stems) {
    const auto files = open_parts(c, stem);
    for (int k = 0; k < to_parts; ++k) {
      std::vector<std::pair<const SavedParam*, const PartMap*>> mine;
      std::vector<SafetensorsWriter::Spec> specs;
      for (const auto& p : t.index.params) {
        for (const auto& piece : p.pieces) {
          if (piece.part != k) continue;
          const SavedParam& from = *source.at(p.name);
          const TensorEntry* shape = shapes.at(k)->header().find(p.name);
          const TensorEntry* e = files.at(from.pieces.front().part)->header().find(p.name);
          STRATA_CHECK(shape != nullptr && e != nullptr, "parameter ", p.name, " is missing from a tensor file");
          mine.push_back({&from, &piece.map});
          specs.push_back({p.name, e->dtype, shape->shape});
        }
      }
      write_recut(w, part_file(stem, k, to_parts), stem, specs, mine, files, c.reader.dir(), block, st);
    }
  }
  json module_state = json::array();
  for (const std::string& f : x.module_state_files) {  // names unchanged: a load looks in every listed file
    w.write_text(f, c.reader.read_text(f));
    module_state.push_back(f);
  }
  const json rng = first_part_rng(c, to_parts, w);
  json state = c.state;
  state["layout"] = t.state.at("layout");
  state["world_size"] = t.state.value("world_size", 1);
  state["zero_stage"] = t.state.value("zero_stage", 0);
  state["rng"] = rng;
  state["module_state"] = module_state;
  std::map<std::string, json> pieces;
  for (const json& p : t.state.at("parameters")) pieces[p.at("name")] = p.value("pieces", json());
  for (json& p : state["parameters"]) {
    const json& want = pieces.at(p.at("name").get<std::string>());
    if (want.is_null()) {
      p.erase("pieces");
    } else {
      p["pieces"] = want;
    }
  }
  return commit(w, state, st, x, t0);
}

}  // namespace strata::checkpoint
