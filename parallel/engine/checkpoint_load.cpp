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
#include <memory>
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
  CheckpointLoad(Impl& engine, const std::string& whole_dir)
      : impl(engine), s(engine.ctx), dir(s.tensor_part_dir(whole_dir)), reader(open_dir(whole_dir)) {}

  void run() {
    reader.verify();
    saved = parse_saved_state(reader.read_text("state.json"), reader.path("state.json"), s);
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
      for (ManagedParam& p : s.params) p.has_grad = mid && saved.params.at(p.name).has_grad;
      read_rng_states();
    } catch (const std::exception& e) {
      impl.poisoned = fmt::format("a load of {} failed half way ({}); the engine's state is mixed: load a checkpoint "
                                  "again before training", reader.dir(), e.what());
      throw;
    }
    restore_scalars();
  }

 private:
  checkpoint::CheckpointReader open_dir(const std::string& whole_dir) const {
    STRATA_CHECK(dir == whole_dir || std::filesystem::is_directory(dir) ||
                     std::filesystem::is_directory(dir + ".prev"),
                 "no checkpoint of tensor rank ", s.tensor_group->rank(), " of ", s.tensor_group->world_size(), " at ",
                 dir, ": load a checkpoint saved with the same tensor-parallel layout (",
                 s.tensor_group->world_size(), " ranks, the same plan or layers)");
    checkpoint::CheckpointReader r(dir);
    STRATA_CHECK(r.manifest().kind == kEngineCheckpointKind, "checkpoint ", r.dir(), " was written by \"",
                 r.manifest().kind, "\", not by Engine::save");
    return r;
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

  // Names and shapes: the engine's parameters and the checkpoint's, both ways.
  void check_parameters() const {
    std::vector<std::string> problems;
    for (const ManagedParam& p : s.params) {
      const auto it = saved.params.find(p.name);
      if (it == saved.params.end()) {
        problems.push_back(fmt::format("parameter {} is not in the checkpoint", p.name));
      } else if (it->second.shape != shape_of(p.tensor)) {
        problems.push_back(fmt::format("parameter {} is {} in the checkpoint but {} in the model", p.name,
                                       shape_str(it->second.shape), shape_str(shape_of(p.tensor))));
      }
    }
    if (saved.params.size() > s.params.size() || problems.empty()) {
      std::unordered_set<std::string> mine;
      for (const ManagedParam& p : s.params) mine.insert(p.name);
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
    STRATA_FAIL("checkpoint ", reader.dir(), " does not match the model (nothing was loaded):", list);
  }

  // Every tensor file holds every parameter, in the dtype expected.
  std::unique_ptr<SafetensorsReader> open(const std::string& file, const std::string& dtype) const {
    auto r = std::make_unique<SafetensorsReader>(reader.path(file));
    for (const ManagedParam& p : s.params) {
      const checkpoint::TensorEntry* t = r->header().find(p.name);
      STRATA_CHECK(t != nullptr, r->path(), " has no tensor ", p.name);
      STRATA_CHECK(t->dtype == dtype && t->shape == shape_of(p.tensor), r->path(), ": tensor ", p.name, " is ",
                   t->dtype, " ", shape_str(t->shape), ", expected ", dtype, " ", shape_str(shape_of(p.tensor)));
    }
    return r;
  }

  void open_tensor_files() {
    const std::string compute = st_dtype(s.options.precision);
    master = open("master.safetensors", "F32");
    for (const std::string& state : s.optimizer.state_names()) states.push_back(open(state + ".safetensors", "F32"));
    // The compute copy when it was saved in this precision; otherwise it is cast from the master.
    if (s.options.precision != DType::kFloat32 && reader.has("param.safetensors") &&
        saved.precision == dtype_name(s.options.precision)) {
      param = open("param.safetensors", compute);
    }
    if (mid) grad = open("grad.safetensors", compute);
    for (const std::string& file : saved.rng_files) {
      STRATA_CHECK(reader.has(file), "checkpoint ", reader.dir(), " lists no ", file);
    }
  }

  // Buffers and frozen parameters: every one the module has, by name and shape
  // (checkpoints from before they were saved have none: the module keeps its own).
  void check_module_state() {
    if (!reader.has("module_state.safetensors")) {
      if (!impl.module_state.empty()) {
        STRATA_LOG(kWarn, "checkpoint {} holds no buffers or frozen parameters (saved by an older strata): the "
                   "module keeps its own", reader.dir());
      }
      return;
    }
    module_state = std::make_unique<SafetensorsReader>(reader.path("module_state.safetensors"));
    std::vector<std::string> missing;
    for (const auto& m : impl.module_state) {
      const checkpoint::TensorEntry* e = module_state->header().find(m.name);
      if (e == nullptr) {
        missing.push_back(m.name);
        continue;
      }
      STRATA_CHECK(e->shape == shape_of(m.tensor), "checkpoint ", reader.dir(), ": buffer or frozen parameter ",
                   m.name, " is ", shape_str(e->shape), " there but ", shape_str(shape_of(m.tensor)),
                   " in the model (nothing was loaded)");
      scalar_type_of_st(e->dtype);  // a dtype it cannot take fails here, before anything changes
    }
    STRATA_CHECK(missing.empty(), "checkpoint ", reader.dir(), " has no buffer or frozen parameter ",
                 fmt::format("{}", fmt::join(missing, ", ")), " (nothing was loaded); it was saved from another model");
  }

  // The part of parameter `p` chunk `c` holds (all of it, or this rank's
  // shard's part: Note [Checkpoints across ranks]).
  std::pair<int64_t, int64_t> part(const ManagedParam& p, ChunkId c) const {
    return s.mgr->chunk(c).shard() ? s.owned(p) : std::pair<int64_t, int64_t>{p.offset, p.offset + p.numel};
  }

  void read(const SafetensorsReader& file, const ManagedParam& p, ChunkId c) const {
    const auto [begin, end] = part(p, c);
    if (begin >= end) return;
    const size_t esize = dtype_size(s.mgr->chunk(c).dtype());
    file.read(*file.header().find(p.name), static_cast<size_t>(begin - p.offset) * esize, s.at(c, begin),
              static_cast<size_t>(end - begin) * esize);
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
    std::vector<float> values;
    stream_families(s, fresh_members, [&](ManagedParam& p, const memory::ChunkFamily& fam) {
      const memory::FamilyId f = p.family;
      read(*master, p, fam.master ? *fam.master : s.step_param(f));
      for (size_t k = 0; k < states.size(); ++k) read(*states[k], p, fam.optim_states[k]);
      if (fam.master) {
        const ChunkId pc = s.step_param(f);
        if (param) {
          read(*param, p, pc);
        } else {
          const auto [begin, end] = part(p, pc);
          values.resize(static_cast<size_t>(end - begin));
          master->read(*master->header().find(p.name), static_cast<size_t>(begin - p.offset) * sizeof(float),
                       values.data(), values.size() * sizeof(float));
          kernels::cast(values.data(), DType::kFloat32, s.at(pc, begin), s.options.precision, end - begin);
        }
      }
      if (mid) read(*grad, p, fam.grad);
      p.steps = saved.params.at(p.name).steps;
    });
  }

  void read_module_state() {
    if (!module_state) return;
    torch::NoGradGuard no_grad;
    for (const auto& m : impl.module_state) {
      const checkpoint::TensorEntry& e = *module_state->header().find(m.name);
      std::vector<char> bytes(static_cast<size_t>(e.end - e.begin));
      module_state->read(e, 0, bytes.data(), bytes.size());
      const torch::Tensor v = torch::from_blob(bytes.data(), e.shape, scalar_type_of_st(e.dtype));
      m.tensor.copy_(v);
    }
  }

  void read_rng_states() {
    const std::vector<std::string>& files = saved.rng_files;
    for (auto& [stem, gen] : generators(s.device)) {
      // This rank's state; rank 0's when the checkpoint was saved by fewer ranks.
      std::string file = rng_file(stem, s.rank);
      if (std::find(files.begin(), files.end(), file) == files.end()) file = rng_file(stem, 0);
      if (std::find(files.begin(), files.end(), file) == files.end()) continue;  // saved without a GPU
      if (file != rng_file(stem, s.rank)) {
        STRATA_LOG(kWarn, "checkpoint {} has no {} state for rank {}: it takes rank 0's", reader.dir(), stem, s.rank);
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
  const std::string dir;
  checkpoint::CheckpointReader reader;
  SavedState saved;
  bool mid = false;
  std::unique_ptr<SafetensorsReader> master, param, grad, module_state;
  std::vector<std::unique_ptr<SafetensorsReader>> states;
};

void Engine::load(const std::string& whole_dir) {
  Impl::Busy hold(*impl_);
  Impl::CheckpointLoad(*impl_, whole_dir).run();
}

}  // namespace strata::parallel
