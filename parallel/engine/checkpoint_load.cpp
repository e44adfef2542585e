// Engine::load: Note [Loading a checkpoint] and Note [Checkpoints across
// ranks] (checkpoint_format.h), in the order a load runs: verify the files,
// read state.json, check that the checkpoint fits this engine (optimizer,
// accumulation, parameter names and shapes, tensor files, module state), all
// before anything changes; then stream the tensors into the chunks, the
// module state and the RNG states, and restore the step's scalars.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <unordered_set>

#include "checkpoint_format.h"
#include "engine_impl.h"
#include "family_stream.h"
#include "tensor_files.h"
#include "strata/checkpoint/checkpoint_dir.h"
#include "strata/checkpoint/safetensors.h"

namespace strata::parallel {

using checkpoint::SafetensorsReader;

struct Engine::Impl::CheckpointLoad {
  CheckpointLoad(Impl& engine, const std::string& dir)
      : impl(engine),
        s(engine.ctx),
        tensor(s.tensor_group != nullptr && s.tensor_group->world_size() > 1 ? s.tensor_group : nullptr),
        pipe(s.options.pipeline_group != nullptr && s.options.pipeline_group->world_size() > 1
                 ? s.options.pipeline_group.get()
                 : nullptr),
        parts((tensor ? tensor->world_size() : 1) * (pipe ? pipe->world_size() : 1)),
        part((pipe ? pipe->rank() : 0) * (tensor ? tensor->world_size() : 1) + (tensor ? tensor->rank() : 0)),
        reader(open_dir(dir)) {}

  void run() {
    reader.verify({"state.json"});
    saved = parse_saved_state(reader.read_text("state.json"), reader.path("state.json"), s);
    if (saved.module_state_files.empty() && reader.has("module_state.safetensors")) {
      saved.module_state_files = {"module_state.safetensors"};  // saved before state.json listed them
    }
    mid = saved.mid_accumulation();
    check_compatible();
    check_parameters();
    open_tensor_files();
    check_module_state();
    // Everything checked: from here on the engine changes.
    try {
      read_tensors();
      read_module_state();
      if (!mid) impl.sink->zero();
      for (ManagedParam& p : s.params) p.has_grad = mid && saved.params.at(p.whole_name).has_grad;
      read_rng_states();
    } catch (const std::exception& e) {
      impl.poisoned = fmt::format("a load of {} failed half way ({}); the engine's state is mixed: load a checkpoint "
                                  "again before training", reader.dir(), e.what());
      throw;
    }
    restore_scalars();
  }

 private:
  checkpoint::CheckpointReader open_dir(const std::string& dir) const {
    namespace fs = std::filesystem;
    std::error_code ec;
    for (const char* older : {"tensor-0-of-", "stage-0"}) {
      if (fs::exists(fs::path(dir) / "manifest.json", ec) || !fs::is_directory(dir, ec)) break;
      for (const auto& e : fs::directory_iterator(dir, ec)) {
        STRATA_CHECK(e.path().filename().string().rfind(older, 0) != 0, "checkpoint ", dir, " holds one directory per ",
                     older[0] == 't' ? "tensor rank" : "pipeline stage", " (", e.path().filename().string(),
                     "): an older strata saved it so, and this one saves and loads one checkpoint for every layout. "
                     "Load it with the strata that saved it and save it again");
      }
    }
    checkpoint::CheckpointReader r(dir);
    STRATA_CHECK(r.manifest().kind == kEngineCheckpointKind, "checkpoint ", r.dir(), " was written by \"",
                 r.manifest().kind, "\", not by Engine::save");
    return r;
  }

  std::string layout() const {
    return checkpoint::SavedLayout{tensor ? tensor->world_size() : 1, pipe ? pipe->world_size() : 1, s.world(), s.stage}
        .describe();
  }

  // The optimizer and the accumulation position the checkpoint holds must be this engine's.
  void check_compatible() const {
    STRATA_CHECK(saved.optimizer == optimizer_name(s.optimizer.kind) && saved.states == s.optimizer.state_names(),
                 "checkpoint ", reader.dir(), " holds the state of optimizer ", saved.optimizer, " (",
                 fmt::format("{}", fmt::join(saved.states, ", ")), "), but this engine runs ",
                 optimizer_name(s.optimizer.kind), " (",
                 fmt::format("{}", fmt::join(s.optimizer.state_names(), ", ")),
                 "); attach with the optimizer it was saved with to resume it, or start from its weights "
                 "(export_weights, EngineOptions::init_weights)");
    STRATA_CHECK(!mid || !s.data_parallel(), "checkpoint ", reader.dir(), " holds gradients mid-accumulation, which "
                 "are one process's own; load it with one rank");
    STRATA_CHECK(!mid || saved.grad_accumulation == s.options.grad_accumulation, "checkpoint ", reader.dir(),
                 " was saved after micro-step ", saved.micro_steps % saved.grad_accumulation, " of ",
                 saved.grad_accumulation, "; load it with grad_accumulation ", saved.grad_accumulation,
                 " (this engine has ", s.options.grad_accumulation, ") or save on an accumulation boundary");
    STRATA_CHECK(!mid || saved.precision == dtype_name(s.options.precision), "checkpoint ", reader.dir(),
                 " holds gradients mid-accumulation in ", saved.precision, "; load it with that precision");
  }

  // Names, whole shapes and every element this rank holds, and (one stage
  // holding every parameter) the checkpoint's parameters in the model.
  void check_parameters() const {
    std::vector<std::string> problems;
    for (const ManagedParam& p : s.params) {
      const auto it = saved.params.find(p.whole_name);
      if (it == saved.params.end()) {
        const bool own = p.whole_name.find("@tensor") != std::string::npos;
        problems.push_back(own ? fmt::format("parameter {} is not in the checkpoint: its layer split it without a "
                                             "part map (mark_split), so only the layout that saved it loads it",
                                             p.name)
                               : fmt::format("parameter {} is not in the checkpoint", p.whole_name));
        continue;
      }
      if (it->second.shape != p.part.whole_shape) {
        problems.push_back(fmt::format("parameter {} is {} in the checkpoint but {} in the model", p.whole_name,
                                       shape_str(it->second.shape), shape_str(p.part.whole_shape)));
        continue;
      }
      int64_t covered = 0;
      for (const checkpoint::SavedPiece& piece : it->second.pieces) {
        for (const checkpoint::Overlap& o : checkpoint::overlaps(p.part, 0, p.numel, piece.map)) covered += o.length;
      }
      if (covered < p.numel) {
        problems.push_back(fmt::format("the checkpoint holds {} of the {} elements of parameter {} this rank needs",
                                       covered, p.numel, p.whole_name));
      }
    }
    if (pipe == nullptr && (saved.params.size() > s.params.size() || problems.empty())) {
      std::unordered_set<std::string> mine;
      for (const ManagedParam& p : s.params) mine.insert(p.whole_name);
      for (const auto& [name, _] : saved.params) {
        if (mine.count(name) == 0) {
          problems.push_back(fmt::format("the checkpoint's parameter {} is not in the model", name));
        }
      }
    }
    if (problems.empty()) return;
    std::string list;
    for (size_t i = 0; i < std::min<size_t>(problems.size(), 8); ++i) list += "\n  " + problems[i];
    if (problems.size() > 8) list += fmt::format("\n  ... and {} more", problems.size() - 8);
    STRATA_FAIL("checkpoint ", reader.dir(), " (saved at ", saved.layout.describe(), ") does not match the model (",
                layout(), " here; nothing was loaded):", list);
  }

  // Tensor file `stem` of part `k`, opened once.
  const SafetensorsReader& file(const std::string& stem, int k) const { return *files.at({stem, k}); }

  // The parts this rank reads from, their files verified and opened, and
  // every piece it reads there of the dtype and size expected.
  void open_tensor_files() {
    std::set<int> needed;
    for (const ManagedParam& p : s.params) {
      for (const checkpoint::SavedPiece& piece : saved.params.at(p.whole_name).pieces) {
        if (!checkpoint::overlaps(p.part, 0, p.numel, piece.map).empty()) needed.insert(piece.part);
      }
    }
    std::vector<std::string> stems = {"master"};
    for (const std::string& state : s.optimizer.state_names()) stems.push_back(state);
    // The compute copy when it was saved in this precision; otherwise it is cast from the master.
    with_param = s.options.precision != DType::kFloat32 && saved.precision == dtype_name(s.options.precision);
    for (int k : needed) with_param = with_param && reader.has(part_file("param", k, saved.layout.parts()));
    if (with_param) stems.push_back("param");
    if (mid) stems.push_back("grad");
    std::vector<std::string> names = saved.module_state_files;
    for (int k : needed) {
      for (const std::string& stem : stems) names.push_back(part_file(stem, k, saved.layout.parts()));
    }
    for (const std::string& f : saved.rng_files) {
      STRATA_CHECK(reader.has(f), "checkpoint ", reader.dir(), " lists no ", f);
      names.push_back(f);  // small: every rank checks them all
    }
    reader.verify(names);
    const std::string compute = st_dtype(s.options.precision);
    for (int k : needed) {
      for (const std::string& stem : stems) {
        files[{stem, k}] = std::make_unique<SafetensorsReader>(reader.path(part_file(stem, k, saved.layout.parts())));
      }
    }
    for (const ManagedParam& p : s.params) {
      for (const checkpoint::SavedPiece& piece : saved.params.at(p.whole_name).pieces) {
        if (needed.count(piece.part) == 0) continue;
        for (const std::string& stem : stems) {
          const SafetensorsReader& r = file(stem, piece.part);
          const std::string dtype = stem == "param" || stem == "grad" ? compute : "F32";
          const checkpoint::TensorEntry* t = r.header().find(p.whole_name);
          STRATA_CHECK(t != nullptr, r.path(), " has no tensor ", p.whole_name);
          STRATA_CHECK(t->dtype == dtype && static_cast<int64_t>(t->numel()) == piece.map.part_elems(), r.path(),
                       ": tensor ", p.whole_name, " is ", t->dtype, " ", shape_str(t->shape), ", expected ", dtype,
                       " of ", piece.map.part_elems(), " elements");
        }
      }
    }
  }

  // This rank's elements [begin, end) of parameter `p` (offsets in its part)
  // from tensor file `stem`, to `dst`: every saved piece's overlap with them.
  void read_range(const std::string& stem, const ManagedParam& p, int64_t begin, int64_t end, char* dst,
                  size_t esize) const {
    for (const checkpoint::SavedPiece& piece : saved.params.at(p.whole_name).pieces) {
      const std::vector<checkpoint::Overlap> ov = checkpoint::overlaps(p.part, begin, end, piece.map);
      if (ov.empty()) continue;
      const SafetensorsReader& r = file(stem, piece.part);
      const checkpoint::TensorEntry& t = *r.header().find(p.whole_name);
      for (const checkpoint::Overlap& o : ov) {
        r.read(t, static_cast<size_t>(o.src) * esize, dst + static_cast<size_t>(o.dst - begin) * esize,
               static_cast<size_t>(o.length) * esize);
      }
    }
  }

  // Buffers and frozen parameters: every one the module has, by name and shape,
  // from whichever part's file holds it (checkpoints from before they were
  // saved have none: the module keeps its own).
  void check_module_state() {
    if (saved.module_state_files.empty()) {
      if (!impl.module_state.empty()) {
        STRATA_LOG(kWarn, "checkpoint {} holds no buffers or frozen parameters (saved by an older strata): the "
                   "module keeps its own", reader.dir());
      }
      return;
    }
    for (const std::string& f : saved.module_state_files) {
      module_states.push_back(std::make_unique<SafetensorsReader>(reader.path(f)));
    }
    std::vector<std::string> missing;
    for (const auto& m : impl.module_state) {
      const std::string name = s.options.checkpoint_name ? s.options.checkpoint_name(m.name) : m.name;
      const checkpoint::TensorEntry* e = nullptr;
      for (const auto& r : module_states) {
        if ((e = r->header().find(name)) != nullptr) {
          module_state.push_back({r.get(), e});
          break;
        }
      }
      if (e == nullptr) {
        missing.push_back(name);
        continue;
      }
      STRATA_CHECK(e->shape == shape_of(m.tensor), "checkpoint ", reader.dir(), ": buffer or frozen parameter ",
                   name, " is ", shape_str(e->shape), " there but ", shape_str(shape_of(m.tensor)),
                   " in the model (nothing was loaded)");
      scalar_type_of_st(e->dtype);  // a dtype it cannot take fails here, before anything changes
    }
    STRATA_CHECK(missing.empty(), "checkpoint ", reader.dir(), " has no buffer or frozen parameter ",
                 fmt::format("{}", fmt::join(missing, ", ")), " (nothing was loaded); it was saved from another model");
  }

  // The part of parameter `p` chunk `c` holds (all of it, or this rank's
  // shard's part: Note [Checkpoints across ranks]).
  std::pair<int64_t, int64_t> part_of(const ManagedParam& p, ChunkId c) const {
    return s.mgr->chunk(c).shard() ? s.owned(p) : std::pair<int64_t, int64_t>{p.offset, p.offset + p.numel};
  }

  void read(const std::string& stem, const ManagedParam& p, ChunkId c) const {
    const auto [begin, end] = part_of(p, c);
    if (begin >= end) return;
    read_range(stem, p, begin - p.offset, end - p.offset, s.at(c, begin), dtype_size(s.mgr->chunk(c).dtype()));
  }

  void read_tensors() {
    // Every byte of these chunks is about to be overwritten: their payloads
    // are dropped before pinning, so pinning materialises them on host
    // instead of reading them back from the device or NVMe.
    auto fresh_members = [&](memory::FamilyId f) {
      const memory::ChunkFamily& fam = s.mgr->family(f);
      std::vector<ChunkId> chunks = {fam.master ? *fam.master : s.step_param(f)};
      chunks.insert(chunks.end(), fam.optim_states.begin(), fam.optim_states.end());
      if (fam.master) chunks.push_back(s.step_param(f));
      if (mid) chunks.push_back(fam.grad);
      for (ChunkId c : chunks) s.mgr->release(c);
      return chunks;
    };
    const std::vector<std::string> states = s.optimizer.state_names();
    std::vector<float> values;
    stream_families(s, fresh_members, [&](ManagedParam& p, const memory::ChunkFamily& fam) {
      const memory::FamilyId f = p.family;
      read("master", p, fam.master ? *fam.master : s.step_param(f));
      for (size_t k = 0; k < states.size(); ++k) read(states[k], p, fam.optim_states[k]);
      if (fam.master) {
        const ChunkId pc = s.step_param(f);
        if (with_param) {
          read("param", p, pc);
        } else {
          const auto [begin, end] = part_of(p, pc);
          values.resize(static_cast<size_t>(end - begin));
          read_range("master", p, begin - p.offset, end - p.offset, reinterpret_cast<char*>(values.data()),
                     sizeof(float));
          kernels::cast(values.data(), DType::kFloat32, s.at(pc, begin), s.options.precision, end - begin);
        }
      }
      if (mid) read("grad", p, fam.grad);
      p.steps = saved.params.at(p.whole_name).steps;
    });
  }

  void read_module_state() {
    if (module_state.empty()) return;
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < impl.module_state.size(); ++i) {
      const auto [r, e] = module_state[i];
      std::vector<char> bytes(static_cast<size_t>(e->end - e->begin));
      r->read(*e, 0, bytes.data(), bytes.size());
      const torch::Tensor v = torch::from_blob(bytes.data(), e->shape, scalar_type_of_st(e->dtype));
      impl.module_state[i].tensor.copy_(v);
    }
  }

  void read_rng_states() {
    const std::vector<std::string>& files = saved.rng_files;
    auto listed = [&](const std::string& f) { return std::find(files.begin(), files.end(), f) != files.end(); };
    for (auto& [stem, gen] : generators(s.device)) {
      // This rank's state under the layout that saved it; else its data
      // rank's in the first part (replicas keep distinct streams); else the first rank's.
      const std::string own = saved.layout.parts() == parts ? rng_file(stem, s.rank, part, parts) : std::string();
      std::string file = own;
      if (!listed(file)) file = rng_file(stem, s.rank, 0, saved.layout.parts());
      if (!listed(file)) file = rng_file(stem, 0, 0, saved.layout.parts());
      if (!listed(file)) continue;  // saved without a GPU
      if (file != own) {
        STRATA_LOG(kWarn, "checkpoint {} has no {} state for this rank's place in the layout ({} there): it "
                   "takes {}", reader.dir(), stem, saved.layout.describe(), file);
      }
      const std::string path = reader.path(file);
      std::string bytes = reader.read_text(file);
      torch::Tensor t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
      std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
      std::lock_guard<std::mutex> lock(gen.mutex());
      try {
        gen.set_state(t);
      } catch (const std::exception& e) {
        STRATA_FAIL(path, ": not a generator state this LibTorch accepts (", e.what(), ")");
      }
    }
  }

  // The accumulation position, the loss scaler, and the optimizer's
  // hyper-parameters and schedule, as torch's load_state_dict restores them.
  void restore_scalars() {
    impl.micro_steps = saved.micro_steps;
    impl.pipeline->restore_scaler(saved.loss_scale, saved.clean_steps, saved.skipped);
    impl.pipeline->restore_previous_grad_norm(saved.previous_grad_norm);
    impl.pipeline->restore_gradient_arrivals(saved.gradient_arrivals);
    for (const GroupSettings& saved_group : saved.groups) {
      for (GroupSettings& g : s.groups) {
        if (g.name == saved_group.name) g = saved_group;
      }
    }
    if (saved.schedule) s.optimizer.schedule = *saved.schedule;
    s.optimizer.dampening = saved.dampening;
    s.optimizer.nesterov = saved.nesterov;
    impl.pipeline->set_optimizer_steps(saved.optimizer_steps);
    impl.poisoned.clear();
  }

  Impl& impl;
  EngineContext& s;
  Communicator* const tensor;  // null: no tensor parallelism
  Communicator* const pipe;    // null: no pipeline
  const int parts, part;       // this layout's writers, and this rank's (Note [Checkpoints across layouts])
  checkpoint::CheckpointReader reader;
  SavedState saved;
  bool mid = false, with_param = false;
  std::map<std::pair<std::string, int>, std::unique_ptr<SafetensorsReader>> files;  // (stem, part)
  std::vector<std::unique_ptr<SafetensorsReader>> module_states;
  std::vector<std::pair<const SafetensorsReader*, const checkpoint::TensorEntry*>> module_state;  // by module_state
};

void Engine::load(const std::string& dir) {
  Impl::Busy hold(*impl_);
  Impl::CheckpointLoad(*impl_, dir).run();
}

}  // namespace strata::parallel
