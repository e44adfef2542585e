// Engine::save and load (export_weights and the weight import are in weights.cpp).
//
// Note [Saving a checkpoint]
// A checkpoint holds what training needs to continue bit for bit, in a form
// that does not depend on placement: per parameter (by name, in the module's
// naming) its fp32 master weights, its optimizer state under torch's names
// (exp_avg and exp_avg_sq for Adam and AdamW, exp_avg for Lion,
// momentum_buffer for SGD with momentum), the compute copy in mixed
// precision, the gradient when saved mid-accumulation, and its step count;
// the optimizer's kind, each parameter group's hyper-parameters, the
// learning-rate schedule and its position, the loss scaler, the accumulation
// position and the RNG states. load() restores the hyper-parameters and the
// schedule (as torch's load_state_dict does) and refuses a checkpoint of
// another optimizer.
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
//
// Note [Checkpoints across ranks]
// Data parallel, save() and export_weights() are collective: every rank calls
// them, and rank 0 writes the one checkpoint, in the same format as a single
// process's. Under ZeRO each family's sharded chunks are all-gathered, one
// family at a time, so rank 0 writes whole tensors and no rank holds more than
// a family's chunks beyond its shards. Every rank's RNG state is kept
// (rng_cpu.bin is rank 0's, rng_cpu.rank<R>.bin rank R's). load() is called by
// every rank, each reading what it owns (its shards' ranges of each tensor),
// so a checkpoint loads at any ZeRO stage and any number of ranks, and each
// rank gets its own RNG state back when the world size matches. Gradients
// mid-accumulation are rank-local, so a data-parallel save must be on an
// accumulation boundary. When rank 0 cannot write (a full disk, a bad path),
// it keeps taking part in the gathers and a final all-reduce tells every
// rank, so all of them fail at once instead of waiting for a timeout, and
// the previous checkpoint stays.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "../zero/sharding.h"
#include "engine_impl.h"
#include "family_stream.h"
#include "tensor_files.h"
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

// The RNG states of the CPU generator and, on a GPU, the device's, by file
// name stem ("rng_cpu": rng_cpu.bin for rank 0, rng_cpu.rank<R>.bin for rank R).
std::vector<std::pair<std::string, at::Generator>> generators(const torch::Device& device) {
  std::vector<std::pair<std::string, at::Generator>> g = {{"rng_cpu", at::detail::getDefaultCPUGenerator()}};
  if (device.is_cuda()) g.emplace_back("rng_cuda", at::globalContext().defaultGenerator(device));
  return g;
}

std::string rng_file(const std::string& stem, int rank) {
  return rank == 0 ? stem + ".bin" : fmt::format("{}.rank{}.bin", stem, rank);
}

// Every rank's `mine`, in rank order (sizes may differ).
std::vector<std::string> all_gather_bytes(Communicator& comm, const std::string& mine) {
  const int n = comm.world_size();
  const std::vector<double> sizes = all_gather_values(comm, {static_cast<double>(mine.size())});
  size_t most = 0;
  for (double v : sizes) most = std::max(most, static_cast<size_t>(v));
  const size_t words = (most + sizeof(float) - 1) / sizeof(float);
  std::vector<float> in(words), out(words * static_cast<size_t>(n));
  std::memcpy(in.data(), mine.data(), mine.size());
  comm.all_gather(in.data(), out.data(), words, DType::kFloat32)->wait();
  std::vector<std::string> all;
  for (int r = 0; r < n; ++r) {
    const char* at = reinterpret_cast<const char*>(out.data() + static_cast<size_t>(r) * words);
    all.emplace_back(at, static_cast<size_t>(sizes[r]));
  }
  return all;
}

// Buffers and frozen parameters as they were before attach cast them: on CPU, contiguous.
torch::Tensor state_value(const torch::Tensor& tensor, torch::ScalarType original) {
  return tensor.detach().to(torch::kCPU, original).contiguous();
}

// The optimizer's kind, state arrays, each group's hyper-parameters and the
// schedule with its position (Note [Saving a checkpoint]).
json optimizer_state(const EngineContext& s, int64_t optimizer_steps) {
  json groups = json::array();
  for (const GroupSettings& g : s.groups) {
    groups.push_back({{"name", g.name}, {"lr", g.lr}, {"weight_decay", g.weight_decay}, {"beta1", g.beta1},
                      {"beta2", g.beta2}, {"eps", g.eps}, {"momentum", g.momentum}});
  }
  const LrSchedule& sch = s.optimizer.schedule;
  return {{"kind", optimizer_name(s.optimizer.kind)},
          {"states", s.optimizer.state_names()},
          {"dampening", s.optimizer.dampening},
          {"nesterov", s.optimizer.nesterov},
          {"groups", groups},
          {"schedule", {{"kind", sch.kind_name()}, {"warmup_steps", sch.warmup_steps}, {"total_steps", sch.total_steps},
                        {"warmup_start_factor", sch.warmup_start_factor}, {"min_lr_ratio", sch.min_lr_ratio}}},
          {"optimizer_steps", optimizer_steps}};
}

LrSchedule::Kind schedule_kind(const std::string& name) {
  for (LrSchedule::Kind k : {LrSchedule::Kind::kConstant, LrSchedule::Kind::kWarmupCosine,
                             LrSchedule::Kind::kWarmupLinear}) {
    LrSchedule probe;
    probe.kind = k;
    if (name == probe.kind_name()) return k;
  }
  STRATA_FAIL("unknown lr schedule \"", name, "\"");
}


}  // namespace

void Engine::check_save_target(const std::string& dir) { checkpoint::check_replaceable(dir); }
void Engine::check_export_target(const std::string& path) { checkpoint::check_writable_file(path); }

// See Note [Saving a checkpoint] and Note [Checkpoints across ranks].
void Engine::save(const std::string& whole_dir) {
  Impl& impl = *impl_;
  Impl::Busy hold(impl);
  EngineContext& s = impl.ctx;
  const std::string dir = s.tensor_part_dir(whole_dir);
  STRATA_CHECK(impl.poisoned.empty(), impl.poisoned);
  const std::vector<size_t> order = params_in_chunk_order(s);
  const bool mid = impl.micro_steps % s.options.grad_accumulation != 0;
  STRATA_CHECK(!mid || !s.data_parallel(), "save() after micro-step ", impl.micro_steps % s.options.grad_accumulation,
               " of ", s.options.grad_accumulation, ": data parallel gradients mid-accumulation are each rank's own; "
               "save on an accumulation boundary");
  const bool mixed = s.options.precision != DType::kFloat32;
  const bool lead = s.rank == 0;
  // Data parallel, a write failure on rank 0 must not leave the other ranks
  // waiting in the next family's gather: rank 0 records it, keeps taking part
  // in the collectives, and every rank learns of it at the end.
  std::exception_ptr write_failure;
  bool writing = lead;
  const auto failed = [&] {
    if (!s.data_parallel()) throw;
    if (!write_failure) write_failure = std::current_exception();
    writing = false;
  };
  std::optional<checkpoint::CheckpointWriter> w;

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
  const std::vector<std::string> state_names = s.optimizer.state_names();
  const size_t fp32_outs = 1 + state_names.size();  // the fp32 values and each optimizer state
  if (lead) try {
    w.emplace(dir, kKind);
    outs.push_back({"master.safetensors", std::make_unique<SafetensorsWriter>(
                                              w->path("master.safetensors"), fp32,
                                              std::map<std::string, std::string>{{"format", "pt"}})});
    for (const std::string& state : state_names) {
      const std::string file = state + ".safetensors";
      outs.push_back({file, std::make_unique<SafetensorsWriter>(w->path(file), fp32)});
    }
    if (mixed) {
      outs.push_back({"param.safetensors", std::make_unique<SafetensorsWriter>(w->path("param.safetensors"), compute)});
    }
    if (mid) outs.push_back({"grad.safetensors", std::make_unique<SafetensorsWriter>(w->path("grad.safetensors"), compute)});
  } catch (...) {
    failed();
  }

  // What is written per family: the fp32 values, the optimizer state
  // (exp_avg and exp_avg_sq for Adam), the compute copy (mixed precision)
  // and gradients (mid-accumulation).
  auto members = [&](memory::FamilyId f) {
    const memory::ChunkFamily& fam = s.mgr->family(f);
    std::vector<ChunkId> chunks = {fam.master ? *fam.master : s.step_param(f)};
    chunks.insert(chunks.end(), fam.optim_states.begin(), fam.optim_states.end());
    if (mixed) chunks.push_back(s.step_param(f));
    if (mid) chunks.push_back(fam.grad);
    return chunks;
  };
  // Sharded members are gathered whole while their family is pinned.
  std::vector<std::vector<char>> whole;
  std::vector<const char*> base;
  std::vector<offload::CopyTicket> ahead;
  struct Settle {  // read-aheads finish before the save returns or throws
    std::vector<offload::CopyTicket>& t;
    ~Settle() { EngineContext::settle(t); }
  } settle_ahead{ahead};
  stream_families(s, 
      members,
      [&](const ManagedParam& p, const memory::ChunkFamily&) {
        if (!writing) return;
        try {
          for (size_t k = 0; k < outs.size(); ++k) {
            const size_t esize = k < fp32_outs ? sizeof(float) : s.elem_size();
            outs[k].w->append(base[k] + static_cast<size_t>(p.offset) * esize, static_cast<size_t>(p.numel) * esize);
          }
        } catch (...) {
          failed();
        }
      },
      [&](size_t i) {
        const memory::FamilyId f = s.families[i];
        const std::vector<ChunkId> chunks = members(f);
        whole.resize(chunks.size());
        base.assign(chunks.size(), nullptr);
        for (size_t k = 0; k < chunks.size(); ++k) {
          const memory::Chunk& c = s.mgr->chunk(chunks[k]);
          if (!c.shard()) {
            base[k] = static_cast<const char*>(s.mgr->data(chunks[k]));
            continue;
          }
          const size_t esize = dtype_size(c.dtype());
          whole[k].resize(static_cast<size_t>(s.mgr->family(f).layout->capacity_elems) * esize);
          gather_shards(s, chunks[k], s.mgr->data(chunks[k]), whole[k].data());
          base[k] = whole[k].data();
        }
        // While family i is written out, the next one comes to host (from
        // the device or NVMe) if it fits in the free host bytes.
        if (i + 1 < s.families.size()) s.read_ahead(members(s.families[i + 1]), ahead, /*only_into_free=*/true);
      });

  // Buffers and frozen parameters (rank 0's, as DDP keeps them): one small file.
  if (writing && !impl.module_state.empty()) try {
    std::vector<SafetensorsWriter::Spec> specs;
    for (const auto& m : impl.module_state) specs.push_back({m.name, st_dtype_of(m.original), shape_of(m.tensor)});
    SafetensorsWriter sw(w->path("module_state.safetensors"), specs);
    for (const auto& m : impl.module_state) {
      const torch::Tensor v = state_value(m.tensor, m.original);
      sw.append(v.data_ptr(), static_cast<size_t>(v.numel()) * v.element_size());
    }
    sw.finish();
    w->add("module_state.safetensors", sw.bytes(), sw.checksum());
  } catch (...) {
    failed();
  }
  json params = json::array();
  for (size_t i : order) {
    const ManagedParam& p = s.params[i];
    params.push_back({{"name", p.name}, {"shape", shape_of(p.tensor)}, {"steps", p.steps}, {"has_grad", p.has_grad}});
  }
  json rng = json::array();
  std::vector<std::pair<std::string, std::string>> rng_states;  // file, bytes
  for (auto& [stem, gen] : generators(s.device)) {
    torch::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state().contiguous();
    }
    const std::string mine(static_cast<const char*>(state.data_ptr()), static_cast<size_t>(state.numel()));
    const std::vector<std::string> all = s.data_parallel() ? all_gather_bytes(*s.comm, mine) : std::vector{mine};
    for (size_t r = 0; r < all.size(); ++r) rng_states.emplace_back(rng_file(stem, static_cast<int>(r)), all[r]);
  }
  if (writing) try {
    for (Out& o : outs) {
      o.w->finish();
      w->add(o.name, o.w->bytes(), o.w->checksum());
    }
    for (const auto& [file, bytes] : rng_states) {
      checkpoint::FileWriter fw(w->path(file));
      fw.write(bytes.data(), bytes.size());
      fw.finish();
      w->add(file, fw.bytes(), fw.checksum());
      rng.push_back(file);
    }
    const json state = {{"format", "strata-engine-state"},
                        {"precision", dtype_name(s.options.precision)},
                        {"grad_accumulation", s.options.grad_accumulation},
                        {"micro_steps", impl.micro_steps},
                        {"loss_scale", impl.pipeline->loss_scale()},
                        {"clean_steps", impl.pipeline->clean_steps()},
                        {"skipped_steps", impl.pipeline->skipped()},
                        {"world_size", s.world()},
                        {"zero_stage", s.stage},
                        {"optimizer", optimizer_state(s, impl.pipeline->optimizer_steps())},
                        {"rng", rng},
                        {"parameters", params}};
    w->write_text("state.json", state.dump(1) + "\n");
    w->commit();
  } catch (...) {
    failed();
  }
  // Nobody returns (and perhaps loads) before the checkpoint is in place, and
  // every rank fails when rank 0 could not write it.
  if (s.data_parallel()) {
    float rank0_failed = write_failure ? 1.0f : 0.0f;
    s.comm->all_reduce(&rank0_failed, 1, DType::kFloat32, ReduceOp::kMax)->wait();
    if (write_failure) std::rethrow_exception(write_failure);
    STRATA_CHECK(rank0_failed == 0.0f, "rank 0 could not write checkpoint ", dir,
                 " (its error says why); the previous checkpoint there, if any, is unchanged");
  }
}

// See Note [Loading a checkpoint].
void Engine::load(const std::string& whole_dir) {
  Impl& impl = *impl_;
  Impl::Busy hold(impl);
  EngineContext& s = impl.ctx;
  const std::string dir = s.tensor_part_dir(whole_dir);
  STRATA_CHECK(dir == whole_dir || std::filesystem::is_directory(dir) || std::filesystem::is_directory(dir + ".prev"),
               "no checkpoint of tensor rank ", s.tensor_group->rank(), " of ", s.tensor_group->world_size(), " at ",
               dir, ": load a checkpoint saved with the same tensor-parallel layout (",
               s.tensor_group->world_size(), " ranks, the same plan or layers)");
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
  // Checkpoints from before optimizer groups hold AdamW state and no "optimizer" entry.
  std::string saved_kind = "adamw";
  std::vector<std::string> saved_states = {"exp_avg", "exp_avg_sq"};
  std::vector<GroupSettings> saved_groups;
  std::optional<LrSchedule> saved_schedule;
  double dampening = s.optimizer.dampening;
  bool nesterov = s.optimizer.nesterov;
  int64_t optimizer_steps = 0;
  try {
    STRATA_CHECK(st.at("format") == "strata-engine-state", "not an engine state");
    precision = st.at("precision").get<std::string>();
    grad_accumulation = st.at("grad_accumulation").get<int>();
    micro_steps = st.at("micro_steps").get<int>();
    scale = st.at("loss_scale").get<double>();
    clean_steps = st.at("clean_steps").get<int>();
    skipped = st.at("skipped_steps").get<int64_t>();
    rng_files = st.at("rng").get<std::vector<std::string>>();
    if (st.contains("optimizer")) {
      const json& o = st.at("optimizer");
      saved_kind = o.at("kind").get<std::string>();
      saved_states = o.at("states").get<std::vector<std::string>>();
      dampening = o.at("dampening").get<double>();
      nesterov = o.at("nesterov").get<bool>();
      for (const json& g : o.at("groups")) {
        saved_groups.push_back({g.at("name").get<std::string>(), g.at("lr").get<double>(),
                                g.at("weight_decay").get<double>(), g.at("beta1").get<double>(),
                                g.at("beta2").get<double>(), g.at("eps").get<double>(), g.at("momentum").get<double>()});
      }
      const json& sch = o.at("schedule");
      LrSchedule schedule;
      schedule.kind = schedule_kind(sch.at("kind").get<std::string>());
      schedule.warmup_steps = sch.at("warmup_steps").get<int64_t>();
      schedule.total_steps = sch.at("total_steps").get<int64_t>();
      schedule.warmup_start_factor = sch.at("warmup_start_factor").get<double>();
      schedule.min_lr_ratio = sch.at("min_lr_ratio").get<double>();
      schedule.validate();
      saved_schedule = schedule;
      optimizer_steps = o.at("optimizer_steps").get<int64_t>();
      STRATA_CHECK(optimizer_steps >= 0, "negative optimizer_steps");
    }
    for (const json& p : st.at("parameters")) {
      Saved v{p.at("shape").get<std::vector<int64_t>>(), p.at("steps").get<int64_t>(), p.at("has_grad").get<bool>()};
      STRATA_CHECK(saved.emplace(p.at("name").get<std::string>(), v).second, "parameter ", p.at("name"), " twice");
    }
  } catch (const std::exception& e) {
    STRATA_FAIL(state_path, ": malformed engine state: ", e.what());
  }
  STRATA_CHECK(grad_accumulation >= 1 && micro_steps >= 0 && scale >= 1.0, state_path,
               ": out-of-range accumulation, micro-step or loss scale");
  STRATA_CHECK(saved_kind == optimizer_name(s.optimizer.kind) && saved_states == s.optimizer.state_names(),
               "checkpoint ", r.dir(), " holds the state of optimizer ", saved_kind, " (",
               fmt::format("{}", fmt::join(saved_states, ", ")), "), but this engine runs ",
               optimizer_name(s.optimizer.kind), " (", fmt::format("{}", fmt::join(s.optimizer.state_names(), ", ")),
               "); attach with the optimizer it was saved with to resume it, or start from its weights "
               "(export_weights, EngineOptions::init_weights)");
  const bool mid = micro_steps % grad_accumulation != 0;
  STRATA_CHECK(!mid || !s.data_parallel(), "checkpoint ", r.dir(), " holds gradients mid-accumulation, which are "
               "one process's own; load it with one rank");
  STRATA_CHECK(!mid || grad_accumulation == s.options.grad_accumulation, "checkpoint ", r.dir(),
               " was saved after micro-step ", micro_steps % grad_accumulation, " of ", grad_accumulation,
               "; load it with grad_accumulation ", grad_accumulation, " (this engine has ",
               s.options.grad_accumulation, ") or save on an accumulation boundary");
  STRATA_CHECK(!mid || precision == dtype_name(s.options.precision), "checkpoint ", r.dir(),
               " holds gradients mid-accumulation in ", precision, "; load it with that precision");

  // Names and shapes: the engine's parameters and the checkpoint's, both ways.
  std::vector<std::string> problems;
  for (const ManagedParam& p : s.params) {
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
    for (const ManagedParam& p : s.params) mine.insert(p.name);
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
    for (const ManagedParam& p : s.params) {
      const checkpoint::TensorEntry* t = reader->header().find(p.name);
      STRATA_CHECK(t != nullptr, reader->path(), " has no tensor ", p.name);
      STRATA_CHECK(t->dtype == dtype && t->shape == shape_of(p.tensor), reader->path(), ": tensor ", p.name, " is ",
                   t->dtype, " ", shape_str(t->shape), ", expected ", dtype, " ", shape_str(shape_of(p.tensor)));
    }
    return reader;
  };
  const auto master = open("master.safetensors", "F32");
  std::vector<std::unique_ptr<SafetensorsReader>> states;
  for (const std::string& state : s.optimizer.state_names()) states.push_back(open(state + ".safetensors", "F32"));
  // The compute copy when it was saved in this precision; otherwise it is cast from the master.
  std::unique_ptr<SafetensorsReader> param, grad;
  if (s.options.precision != DType::kFloat32 && r.has("param.safetensors") &&
      precision == dtype_name(s.options.precision)) {
    param = open("param.safetensors", compute);
  }
  if (mid) grad = open("grad.safetensors", compute);
  for (const std::string& file : rng_files) STRATA_CHECK(r.has(file), "checkpoint ", r.dir(), " lists no ", file);
  // Buffers and frozen parameters: every one the module has, by name and shape
  // (checkpoints from before they were saved have none: the module keeps its own).
  std::unique_ptr<SafetensorsReader> module_state;
  if (r.has("module_state.safetensors")) {
    module_state = std::make_unique<SafetensorsReader>(r.path("module_state.safetensors"));
    std::vector<std::string> missing;
    for (const auto& m : impl.module_state) {
      const checkpoint::TensorEntry* e = module_state->header().find(m.name);
      if (e == nullptr) {
        missing.push_back(m.name);
        continue;
      }
      STRATA_CHECK(e->shape == shape_of(m.tensor), "checkpoint ", r.dir(), ": buffer or frozen parameter ", m.name,
                   " is ", shape_str(e->shape), " there but ", shape_str(shape_of(m.tensor)),
                   " in the model (nothing was loaded)");
      scalar_type_of_st(e->dtype);  // a dtype it cannot take fails here, before anything changes
    }
    STRATA_CHECK(missing.empty(), "checkpoint ", r.dir(), " has no buffer or frozen parameter ",
                 fmt::format("{}", fmt::join(missing, ", ")), " (nothing was loaded); it was saved from another model");
  } else if (!impl.module_state.empty()) {
    STRATA_LOG(kWarn, "checkpoint {} holds no buffers or frozen parameters (saved by an older strata): the module "
               "keeps its own", r.dir());
  }

  // Everything checked: from here on the engine changes.
  try {
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
    // The part of parameter `p` chunk `c` holds (all of it, or this rank's
    // shard's part: Note [Checkpoints across ranks]), from the file.
    auto part = [&](const ManagedParam& p, ChunkId c) {
      return s.mgr->chunk(c).shard() ? s.owned(p) : std::pair<int64_t, int64_t>{p.offset, p.offset + p.numel};
    };
    auto read = [&](const SafetensorsReader& file, const ManagedParam& p, ChunkId c) {
      const auto [begin, end] = part(p, c);
      if (begin >= end) return;
      const size_t esize = dtype_size(s.mgr->chunk(c).dtype());
      file.read(*file.header().find(p.name), static_cast<size_t>(begin - p.offset) * esize, s.at(c, begin),
                static_cast<size_t>(end - begin) * esize);
    };
    std::vector<float> values;
    stream_families(s, fresh_members, [&](ManagedParam& p, const memory::ChunkFamily& fam) {
      const memory::FamilyId f = p.family;
      const ChunkId mc = fam.master ? *fam.master : s.step_param(f);
      read(*master, p, mc);
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
      p.steps = saved.at(p.name).steps;
    });
    if (module_state) {
      torch::NoGradGuard no_grad;
      for (const auto& m : impl.module_state) {
        const checkpoint::TensorEntry& e = *module_state->header().find(m.name);
        std::vector<char> bytes(static_cast<size_t>(e.end - e.begin));
        module_state->read(e, 0, bytes.data(), bytes.size());
        const torch::Tensor v = torch::from_blob(bytes.data(), e.shape, scalar_type_of_st(e.dtype));
        m.tensor.copy_(v);
      }
    }
    if (!mid) impl.sink->zero();
    for (ManagedParam& p : s.params) p.has_grad = mid && saved.at(p.name).has_grad;
    for (auto& [stem, gen] : generators(s.device)) {
      // This rank's state; rank 0's when the checkpoint was saved by fewer ranks.
      std::string file = rng_file(stem, s.rank);
      if (std::find(rng_files.begin(), rng_files.end(), file) == rng_files.end()) file = rng_file(stem, 0);
      if (std::find(rng_files.begin(), rng_files.end(), file) == rng_files.end()) continue;  // saved without a GPU
      if (file != rng_file(stem, s.rank)) {
        STRATA_LOG(kWarn, "checkpoint {} has no {} state for rank {}: it takes rank 0's", r.dir(), stem, s.rank);
      }
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
    impl.poisoned = fmt::format("a load of {} failed half way ({}); the engine's state is mixed: load a checkpoint "
                             "again before training", r.dir(), e.what());
    throw;
  }
  impl.micro_steps = micro_steps;
  impl.pipeline->restore_scaler(scale, clean_steps, skipped);
  // The optimizer's hyper-parameters and the schedule, as torch's load_state_dict restores them.
  for (const GroupSettings& saved_group : saved_groups) {
    for (GroupSettings& g : s.groups) {
      if (g.name == saved_group.name) g = saved_group;
    }
  }
  if (saved_schedule) s.optimizer.schedule = *saved_schedule;
  s.optimizer.dampening = dampening;
  s.optimizer.nesterov = nesterov;
  impl.pipeline->set_optimizer_steps(optimizer_steps);
  impl.poisoned.clear();
}

}  // namespace strata::parallel
