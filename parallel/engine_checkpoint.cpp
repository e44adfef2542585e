// Engine::save, load and export_weights, and safetensors import at attach.
//
// Note [Saving a checkpoint]
// A checkpoint holds what training needs to continue bit for bit, in a form
// that does not depend on placement: per parameter (by name, in the module's
// naming) its fp32 master weights, AdamW exp_avg and exp_avg_sq, the compute
// copy in mixed precision, the gradient when saved mid-accumulation, and its
// step count; the loss scaler, the accumulation position and the RNG states.
// Chunk sizes, budgets and tiers are not in it, so any budgets and placement
// load it. The tensors go to safetensors files, written chunk family by chunk
// family: each family's chunks are brought to host and pinned (from the device
// or NVMe, as the optimizer step does), their parameters' slices appended to
// the files, and unpinned, so the host never holds more than one family's
// chunks for the save. The directory is committed atomically (Note [Atomic
// checkpoint directories] in checkpoint_dir.h).
//
// Note [Loading a checkpoint]
// load() first verifies every file against the manifest (size and XXH3-64),
// then checks the parameter names, shapes and dtypes against the engine's,
// all before it changes anything: a damaged or mismatched checkpoint leaves
// the engine as it was. Then it streams the tensors into the chunks, family
// by family. If reading fails after that point (the disk fails mid-load), the
// engine's state is a mix; it says so, and train_step refuses until a load
// succeeds.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "engine_impl.h"
#include "strata/checkpoint/checkpoint_dir.h"
#include "strata/checkpoint/safetensors.h"

namespace strata::parallel {

using checkpoint::SafetensorsReader;
using checkpoint::SafetensorsWriter;
using json = nlohmann::json;

namespace {

constexpr const char* kKind = "strata-engine";

std::string st_dtype(DType d) {
  switch (d) {
    case DType::kFloat32: return "F32";
    case DType::kBFloat16: return "BF16";
    case DType::kFloat16: return "F16";
  }
  STRATA_FAIL("unknown dtype");
}

std::vector<int64_t> shape_of(const torch::Tensor& t) { return t.sizes().vec(); }

std::string shape_str(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

torch::ScalarType torch_dtype(const std::string& st) {
  if (st == "F32") return torch::kFloat32;
  if (st == "F64") return torch::kFloat64;
  if (st == "F16") return torch::kFloat16;
  if (st == "BF16") return torch::kBFloat16;
  STRATA_FAIL("dtype ", st, " is not a floating type a parameter can take");
}

// The RNG states of the CPU generator and, on a GPU, the device's.
std::vector<std::pair<std::string, at::Generator>> generators(const torch::Device& device) {
  std::vector<std::pair<std::string, at::Generator>> g = {{"rng_cpu.bin", at::detail::getDefaultCPUGenerator()}};
  if (device.is_cuda()) g.emplace_back("rng_cuda.bin", at::globalContext().defaultGenerator(device));
  return g;
}

}  // namespace

// See Note [Saving a checkpoint].
void Engine::save(const std::string& dir) {
  Impl& s = *impl_;
  STRATA_CHECK(s.poisoned.empty(), s.poisoned);
  const std::vector<size_t> order = s.params_in_chunk_order();
  const bool mid = s.micro_steps % s.options.grad_accumulation != 0;
  const bool mixed = s.options.precision != DType::kFloat32;
  const size_t esize = s.elem_size();
  checkpoint::CheckpointWriter w(dir, kKind);

  std::vector<SafetensorsWriter::Spec> fp32, compute;
  for (size_t i : order) {
    fp32.push_back({s.params[i].name, "F32", shape_of(s.params[i].tensor)});
    compute.push_back({s.params[i].name, st_dtype(s.options.precision), shape_of(s.params[i].tensor)});
  }
  struct Out {
    std::string name;
    std::unique_ptr<SafetensorsWriter> w;
  };
  std::vector<Out> outs;
  outs.push_back({"master.safetensors", std::make_unique<SafetensorsWriter>(w.path("master.safetensors"), fp32,
                                                                             std::map<std::string, std::string>{{"format", "pt"}})});
  outs.push_back({"exp_avg.safetensors", std::make_unique<SafetensorsWriter>(w.path("exp_avg.safetensors"), fp32)});
  outs.push_back({"exp_avg_sq.safetensors", std::make_unique<SafetensorsWriter>(w.path("exp_avg_sq.safetensors"), fp32)});
  if (mixed) outs.push_back({"param.safetensors", std::make_unique<SafetensorsWriter>(w.path("param.safetensors"), compute)});
  if (mid) outs.push_back({"grad.safetensors", std::make_unique<SafetensorsWriter>(w.path("grad.safetensors"), compute)});

  auto members = [&](memory::FamilyId f) {
    const memory::ChunkFamily& fam = s.mgr->family(f);
    std::vector<ChunkId> chunks = {fam.master ? *fam.master : fam.param, fam.optim_states[0], fam.optim_states[1]};
    if (mixed) chunks.push_back(fam.param);
    if (mid) chunks.push_back(fam.grad);
    return chunks;
  };
  std::vector<offload::CopyTicket> ahead;
  struct Settle {  // read-aheads finish before the save returns or throws
    std::vector<offload::CopyTicket>& t;
    ~Settle() { Engine::Impl::settle(t); }
  } settle_ahead{ahead};
  s.stream_families(
      members,
      [&](const Impl::Param& p, const memory::ChunkFamily& fam) {
        const auto f32 = static_cast<size_t>(p.offset) * sizeof(float);
        const auto n32 = static_cast<size_t>(p.numel) * sizeof(float);
        outs[0].w->append(static_cast<const char*>(s.mgr->data(fam.master ? *fam.master : fam.param)) + f32, n32);
        outs[1].w->append(static_cast<const char*>(s.mgr->data(fam.optim_states[0])) + f32, n32);
        outs[2].w->append(static_cast<const char*>(s.mgr->data(fam.optim_states[1])) + f32, n32);
        size_t k = 3;
        if (mixed) {
          outs[k++].w->append(static_cast<const char*>(s.mgr->data(fam.param)) + p.offset * esize, p.numel * esize);
        }
        if (mid) outs[k].w->append(static_cast<const char*>(s.mgr->data(fam.grad)) + p.offset * esize, p.numel * esize);
      },
      [&](size_t i) {
        // While family i is written out, the next one comes to host (from
        // the device or NVMe) if it fits in the free host bytes.
        if (i + 1 < s.families.size()) s.read_ahead(members(s.families[i + 1]), ahead, /*only_into_free=*/true);
      });
  for (Out& o : outs) {
    o.w->finish();
    w.add(o.name, o.w->bytes(), o.w->checksum());
  }

  json params = json::array();
  for (size_t i : order) {
    const Impl::Param& p = s.params[i];
    params.push_back({{"name", p.name}, {"shape", shape_of(p.tensor)}, {"steps", p.steps}, {"has_grad", p.has_grad}});
  }
  json rng = json::array();
  for (auto& [file, gen] : generators(s.device)) {
    torch::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state().contiguous();
    }
    checkpoint::FileWriter fw(w.path(file));
    fw.write(state.data_ptr(), static_cast<size_t>(state.numel()));
    fw.finish();
    w.add(file, fw.bytes(), fw.checksum());
    rng.push_back(file);
  }
  const json state = {{"format", "strata-engine-state"},
                      {"precision", dtype_name(s.options.precision)},
                      {"grad_accumulation", s.options.grad_accumulation},
                      {"micro_steps", s.micro_steps},
                      {"loss_scale", s.scale},
                      {"clean_steps", s.clean_steps},
                      {"skipped_steps", s.skipped},
                      {"adamw", {{"lr", s.opt.lr}, {"beta1", s.opt.beta1}, {"beta2", s.opt.beta2}, {"eps", s.opt.eps},
                                 {"weight_decay", s.opt.weight_decay}}},
                      {"rng", rng},
                      {"parameters", params}};
  w.write_text("state.json", state.dump(1) + "\n");
  w.commit();
}

// See Note [Loading a checkpoint].
void Engine::load(const std::string& dir) {
  Impl& s = *impl_;
  checkpoint::CheckpointReader r(dir);
  STRATA_CHECK(r.manifest().kind == kKind, "checkpoint ", r.dir(), " was written by \"", r.manifest().kind,
               "\", not by Engine::save");
  r.verify();
  const std::string state_path = r.path("state.json");
  json st;
  try {
    st = json::parse(r.read_text("state.json"));
  } catch (const json::exception& e) {
    STRATA_FAIL(state_path, ": not JSON (", e.what(), ")");
  }
  struct Saved {
    std::vector<int64_t> shape;
    int64_t steps = 0;
    bool has_grad = false;
  };
  std::unordered_map<std::string, Saved> saved;
  int micro_steps = 0, grad_accumulation = 1, clean_steps = 0;
  int64_t skipped = 0;
  double scale = 1.0;
  std::vector<std::string> rng_files;
  std::string precision;
  try {
    STRATA_CHECK(st.at("format") == "strata-engine-state", "not an engine state");
    precision = st.at("precision").get<std::string>();
    grad_accumulation = st.at("grad_accumulation").get<int>();
    micro_steps = st.at("micro_steps").get<int>();
    scale = st.at("loss_scale").get<double>();
    clean_steps = st.at("clean_steps").get<int>();
    skipped = st.at("skipped_steps").get<int64_t>();
    rng_files = st.at("rng").get<std::vector<std::string>>();
    for (const json& p : st.at("parameters")) {
      Saved v{p.at("shape").get<std::vector<int64_t>>(), p.at("steps").get<int64_t>(), p.at("has_grad").get<bool>()};
      STRATA_CHECK(saved.emplace(p.at("name").get<std::string>(), v).second, "parameter ", p.at("name"), " twice");
    }
  } catch (const std::exception& e) {
    STRATA_FAIL(state_path, ": malformed engine state: ", e.what());
  }
  STRATA_CHECK(grad_accumulation >= 1 && micro_steps >= 0 && scale >= 1.0, state_path,
               ": out-of-range accumulation, micro-step or loss scale");
  const bool mid = micro_steps % grad_accumulation != 0;
  STRATA_CHECK(!mid || grad_accumulation == s.options.grad_accumulation, "checkpoint ", r.dir(),
               " was saved after micro-step ", micro_steps % grad_accumulation, " of ", grad_accumulation,
               "; load it with grad_accumulation ", grad_accumulation, " (this engine has ",
               s.options.grad_accumulation, ") or save on an accumulation boundary");
  STRATA_CHECK(!mid || precision == dtype_name(s.options.precision), "checkpoint ", r.dir(),
               " holds gradients mid-accumulation in ", precision, "; load it with that precision");

  // Names and shapes: the engine's parameters and the checkpoint's, both ways.
  std::vector<std::string> problems;
  for (const Impl::Param& p : s.params) {
    const auto it = saved.find(p.name);
    if (it == saved.end()) {
      problems.push_back(fmt::format("parameter {} is not in the checkpoint", p.name));
    } else if (it->second.shape != shape_of(p.tensor)) {
      problems.push_back(fmt::format("parameter {} is {} in the checkpoint but {} in the model", p.name,
                                     shape_str(it->second.shape), shape_str(shape_of(p.tensor))));
    }
  }
  if (saved.size() > s.params.size() || problems.empty()) {
    std::unordered_set<std::string> mine;
    for (const Impl::Param& p : s.params) mine.insert(p.name);
    for (const auto& [name, _] : saved) {
      if (mine.count(name) == 0) problems.push_back(fmt::format("the checkpoint's parameter {} is not in the model", name));
    }
  }
  if (!problems.empty()) {
    std::string list;
    for (size_t i = 0; i < std::min<size_t>(problems.size(), 8); ++i) list += "\n  " + problems[i];
    if (problems.size() > 8) list += fmt::format("\n  ... and {} more", problems.size() - 8);
    STRATA_FAIL("checkpoint ", r.dir(), " does not match the model (nothing was loaded):", list);
  }
  // Every tensor file holds every parameter, in the dtype expected.
  const std::string compute = st_dtype(s.options.precision);
  auto open = [&](const std::string& file, const std::string& dtype) {
    auto reader = std::make_unique<SafetensorsReader>(r.path(file));
    for (const Impl::Param& p : s.params) {
      const checkpoint::TensorEntry* t = reader->header().find(p.name);
      STRATA_CHECK(t != nullptr, reader->path(), " has no tensor ", p.name);
      STRATA_CHECK(t->dtype == dtype && t->shape == shape_of(p.tensor), reader->path(), ": tensor ", p.name, " is ",
                   t->dtype, " ", shape_str(t->shape), ", expected ", dtype, " ", shape_str(shape_of(p.tensor)));
    }
    return reader;
  };
  const auto master = open("master.safetensors", "F32");
  const auto m = open("exp_avg.safetensors", "F32");
  const auto v = open("exp_avg_sq.safetensors", "F32");
  // The compute copy when it was saved in this precision; otherwise it is cast from the master.
  std::unique_ptr<SafetensorsReader> param, grad;
  if (s.options.precision != DType::kFloat32 && r.has("param.safetensors") &&
      precision == dtype_name(s.options.precision)) {
    param = open("param.safetensors", compute);
  }
  if (mid) grad = open("grad.safetensors", compute);
  for (const std::string& file : rng_files) STRATA_CHECK(r.has(file), "checkpoint ", r.dir(), " lists no ", file);

  // Everything checked: from here on the engine changes.
  const size_t esize = s.elem_size();
  try {
    // Every byte of these chunks is about to be overwritten: their payloads
    // are dropped before pinning, so pinning materialises them on host
    // instead of reading them back from the device or NVMe.
    auto fresh_members = [&](memory::FamilyId f) {
      const memory::ChunkFamily& fam = s.mgr->family(f);
      std::vector<ChunkId> chunks = {fam.master ? *fam.master : fam.param, fam.optim_states[0], fam.optim_states[1]};
      if (fam.master) chunks.push_back(fam.param);
      if (mid) chunks.push_back(fam.grad);
      for (ChunkId c : chunks) s.mgr->release(c);
      return chunks;
    };
    auto read = [](const SafetensorsReader& r, const std::string& name, void* dst, size_t bytes) {
      r.read(*r.header().find(name), 0, dst, bytes);
    };
    s.stream_families(fresh_members, [&](Impl::Param& p, const memory::ChunkFamily& fam) {
      const auto f32 = static_cast<size_t>(p.offset) * sizeof(float);
      const auto n32 = static_cast<size_t>(p.numel) * sizeof(float);
      auto* mp = static_cast<char*>(s.mgr->data(fam.master ? *fam.master : fam.param)) + f32;
      read(*master, p.name, mp, n32);
      read(*m, p.name, static_cast<char*>(s.mgr->data(fam.optim_states[0])) + f32, n32);
      read(*v, p.name, static_cast<char*>(s.mgr->data(fam.optim_states[1])) + f32, n32);
      if (fam.master) {
        char* dst = static_cast<char*>(s.mgr->data(fam.param)) + p.offset * esize;
        if (param) {
          read(*param, p.name, dst, p.numel * esize);
        } else {
          kernels::cast(mp, DType::kFloat32, dst, s.options.precision, p.numel);
        }
      }
      if (mid) read(*grad, p.name, static_cast<char*>(s.mgr->data(fam.grad)) + p.offset * esize, p.numel * esize);
      p.steps = saved.at(p.name).steps;
    });
    if (!mid) s.zero_grads();
    for (Impl::Param& p : s.params) p.has_grad = mid && saved.at(p.name).has_grad;
    for (auto& [file, gen] : generators(s.device)) {
      if (std::find(rng_files.begin(), rng_files.end(), file) == rng_files.end()) continue;  // saved without a GPU
      const std::string path = r.path(file);
      std::string bytes = r.read_text(file);
      torch::Tensor t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
      std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
      std::lock_guard<std::mutex> lock(gen.mutex());
      try {
        gen.set_state(t);
      } catch (const std::exception& e) {
        STRATA_FAIL(path, ": not a generator state this LibTorch accepts (", e.what(), ")");
      }
    }
  } catch (const std::exception& e) {
    s.poisoned = fmt::format("a load of {} failed half way ({}); the engine's state is mixed: load a checkpoint "
                             "again before training", r.dir(), e.what());
    throw;
  }
  s.micro_steps = micro_steps;
  s.scale = s.options.precision == DType::kFloat16 ? scale : 1.0;
  s.clean_steps = clean_steps;
  s.skipped = skipped;
  s.poisoned.clear();
}

void Engine::export_weights(const std::string& path) {
  Impl& s = *impl_;
  STRATA_CHECK(s.poisoned.empty(), s.poisoned);
  const std::vector<size_t> order = s.params_in_chunk_order();
  std::vector<SafetensorsWriter::Spec> specs;
  for (size_t i : order) specs.push_back({s.params[i].name, "F32", shape_of(s.params[i].tensor)});
  for (const auto& [name, t] : s.frozen) specs.push_back({name, "F32", shape_of(t)});
  // Written beside `path` and renamed over it: a reader never sees half a file.
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  try {
    SafetensorsWriter w(tmp, specs, {{"format", "pt"}});
    auto master_chunk = [&](memory::FamilyId f) {
      const memory::ChunkFamily& fam = s.mgr->family(f);
      return std::vector<ChunkId>{fam.master ? *fam.master : fam.param};
    };
    s.stream_families(master_chunk, [&](const Impl::Param& p, const memory::ChunkFamily& fam) {
      w.append(static_cast<const char*>(s.mgr->data(fam.master ? *fam.master : fam.param)) + p.offset * sizeof(float),
               p.numel * sizeof(float));
    });
    for (const auto& [name, t] : s.frozen) {
      const torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
      w.append(c.data_ptr(), static_cast<size_t>(c.numel()) * sizeof(float));
    }
    w.finish();
    STRATA_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename ", tmp, " to ", path, ": ",
                 std::strerror(errno));
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
}

// Copies the tensors of a safetensors file into `module`'s parameters by name.
void import_weights(torch::nn::Module& module, const std::string& path) {
  SafetensorsReader r(path);
  std::vector<std::string> missing;
  std::unordered_set<std::string> used;
  torch::NoGradGuard no_grad;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const checkpoint::TensorEntry* t = r.header().find(item.key());
    if (t == nullptr) {
      missing.push_back(item.key());
      continue;
    }
    used.insert(item.key());
    torch::Tensor dst = item.value();
    STRATA_CHECK(t->shape == shape_of(dst), path, ": tensor ", item.key(), " is ", shape_str(t->shape),
                 " but the module's parameter is ", shape_str(shape_of(dst)));
    torch::Tensor src = torch::empty(t->shape, torch::TensorOptions().dtype(torch_dtype(t->dtype)));
    r.read(*t, 0, src.data_ptr(), t->end - t->begin);
    dst.copy_(src);
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < std::min<size_t>(missing.size(), 5); ++i) list += (i ? ", " : "") + missing[i];
    STRATA_FAIL(path, " has no tensor for ", missing.size(), " of the module's parameters (", list,
                missing.size() > 5 ? ", ..." : "", "); the names must match named_parameters()");
  }
  const size_t extra = r.header().tensors.size() - used.size();
  if (extra > 0) STRATA_LOG(kWarn, "{}: {} tensors match no parameter of the module and were ignored", path, extra);
}

}  // namespace strata::parallel
