// Engine::save: Note [Saving a checkpoint] and Note [Checkpoints across ranks]
// (checkpoint_format.h), in the order a save runs: open the tensor files,
// stream the families into them, the module state, the RNG states, state.json
// and the commit, then the ranks' agreement on whether it worked.
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstring>
#include <exception>
#include <map>
#include <optional>

#include <nlohmann/json.hpp>

#include "../zero/sharding.h"
#include "checkpoint_format.h"
#include "engine_impl.h"
#include "family_stream.h"
#include "tensor_files.h"
#include "strata/checkpoint/checkpoint_dir.h"
#include "strata/checkpoint/safetensors.h"

namespace strata::parallel {

using checkpoint::SafetensorsWriter;
using json = nlohmann::json;

namespace {

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

}  // namespace

struct Engine::Impl::CheckpointSave {
  CheckpointSave(Impl& engine, const std::string& whole_dir)
      : impl(engine),
        s(engine.ctx),
        dir(s.tensor_part_dir(whole_dir)),
        order(params_in_chunk_order(s)),
        mid(engine.micro_steps % s.options.grad_accumulation != 0),
        mixed(s.options.precision != DType::kFloat32),
        lead(s.rank == 0),
        writing(lead) {}

  void run() {
    STRATA_CHECK(impl.poisoned.empty(), impl.poisoned);
    STRATA_CHECK(!mid || !s.data_parallel(), "save() after micro-step ",
                 impl.micro_steps % s.options.grad_accumulation, " of ", s.options.grad_accumulation,
                 ": data parallel gradients mid-accumulation are each rank's own; save on an accumulation boundary");
    if (lead) try {
      open_outputs();
    } catch (...) {
      failed();
    }
    write_families();
    if (writing && !impl.module_state.empty()) try {
      write_module_state();
    } catch (...) {
      failed();
    }
    const std::vector<std::pair<std::string, std::string>> rng = rng_states();
    if (writing) try {
      write_state_and_commit(rng);
    } catch (...) {
      failed();
    }
    agree();
  }

 private:
  // Data parallel, a write failure on rank 0 must not leave the other ranks
  // waiting in the next family's gather: rank 0 records it, keeps taking part
  // in the collectives, and every rank learns of it at the end (agree()).
  // Called in a catch block; one process rethrows at once.
  void failed() {
    if (!s.data_parallel()) throw;
    if (!write_failure) write_failure = std::current_exception();
    writing = false;
  }

  void open_outputs() {
    std::vector<SafetensorsWriter::Spec> fp32, compute;
    for (size_t i : order) {
      fp32.push_back({s.params[i].name, "F32", shape_of(s.params[i].tensor)});
      compute.push_back({s.params[i].name, st_dtype(s.options.precision), shape_of(s.params[i].tensor)});
    }
    const std::vector<std::string> state_names = s.optimizer.state_names();
    fp32_outs = 1 + state_names.size();  // the fp32 values and each optimizer state
    w.emplace(dir, kEngineCheckpointKind);
    outs.push_back({"master.safetensors",
                    std::make_unique<SafetensorsWriter>(w->path("master.safetensors"), fp32,
                                                        std::map<std::string, std::string>{{"format", "pt"}})});
    for (const std::string& state : state_names) {
      const std::string file = state + ".safetensors";
      outs.push_back({file, std::make_unique<SafetensorsWriter>(w->path(file), fp32)});
    }
    if (mixed) {
      outs.push_back({"param.safetensors", std::make_unique<SafetensorsWriter>(w->path("param.safetensors"), compute)});
    }
    if (mid) outs.push_back({"grad.safetensors", std::make_unique<SafetensorsWriter>(w->path("grad.safetensors"), compute)});
  }

  // What is written per family: the fp32 values, the optimizer state
  // (exp_avg and exp_avg_sq for Adam), the compute copy (mixed precision)
  // and gradients (mid-accumulation).
  std::vector<ChunkId> members(memory::FamilyId f) const {
    const memory::ChunkFamily& fam = s.mgr->family(f);
    std::vector<ChunkId> chunks = {fam.master ? *fam.master : s.step_param(f)};
    chunks.insert(chunks.end(), fam.optim_states.begin(), fam.optim_states.end());
    if (mixed) chunks.push_back(s.step_param(f));
    if (mid) chunks.push_back(fam.grad);
    return chunks;
  }

  // Family by family; sharded members are gathered whole while their family is pinned.
  void write_families() {
    std::vector<std::vector<char>> whole;
    std::vector<const char*> base;
    std::vector<offload::CopyTicket> ahead;
    struct Settle {  // read-aheads finish before the save returns or throws
      std::vector<offload::CopyTicket>& t;
      ~Settle() { EngineContext::settle(t); }
    } settle_ahead{ahead};
    stream_families(
        s, [&](memory::FamilyId f) { return members(f); },
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
  }

  // Buffers and frozen parameters (rank 0's, as DDP keeps them): one small file.
  void write_module_state() {
    std::vector<SafetensorsWriter::Spec> specs;
    for (const auto& m : impl.module_state) specs.push_back({m.name, st_dtype_of(m.original), shape_of(m.tensor)});
    SafetensorsWriter sw(w->path("module_state.safetensors"), specs);
    for (const auto& m : impl.module_state) {
      const torch::Tensor v = state_value(m.tensor, m.original);
      sw.append(v.data_ptr(), static_cast<size_t>(v.numel()) * v.element_size());
    }
    sw.finish();
    w->add("module_state.safetensors", sw.bytes(), sw.checksum());
  }

  // Every rank's generator states (collective when data parallel): file, bytes.
  std::vector<std::pair<std::string, std::string>> rng_states() const {
    std::vector<std::pair<std::string, std::string>> states;
    for (auto& [stem, gen] : generators(s.device)) {
      torch::Tensor state;
      {
        std::lock_guard<std::mutex> lock(gen.mutex());
        state = gen.get_state().contiguous();
      }
      const std::string mine(static_cast<const char*>(state.data_ptr()), static_cast<size_t>(state.numel()));
      const std::vector<std::string> all = s.data_parallel() ? all_gather_bytes(*s.comm, mine) : std::vector{mine};
      for (size_t r = 0; r < all.size(); ++r) states.emplace_back(rng_file(stem, static_cast<int>(r)), all[r]);
    }
    return states;
  }

  void write_state_and_commit(const std::vector<std::pair<std::string, std::string>>& rng_states) {
    for (Out& o : outs) {
      o.w->finish();
      w->add(o.name, o.w->bytes(), o.w->checksum());
    }
    json rng = json::array();
    for (const auto& [file, bytes] : rng_states) {
      checkpoint::FileWriter fw(w->path(file));
      fw.write(bytes.data(), bytes.size());
      fw.finish();
      w->add(file, fw.bytes(), fw.checksum());
      rng.push_back(file);
    }
    json params = json::array();
    for (size_t i : order) {
      const ManagedParam& p = s.params[i];
      params.push_back({{"name", p.name}, {"shape", shape_of(p.tensor)}, {"steps", p.steps}, {"has_grad", p.has_grad}});
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
  }

  // Nobody returns (and perhaps loads) before the checkpoint is in place, and
  // every rank fails when rank 0 could not write it.
  void agree() {
    if (!s.data_parallel()) return;
    float rank0_failed = write_failure ? 1.0f : 0.0f;
    s.comm->all_reduce(&rank0_failed, 1, DType::kFloat32, ReduceOp::kMax)->wait();
    if (write_failure) std::rethrow_exception(write_failure);
    STRATA_CHECK(rank0_failed == 0.0f, "rank 0 could not write checkpoint ", dir,
                 " (its error says why); the previous checkpoint there, if any, is unchanged");
  }

  struct Out {
    std::string name;
    std::unique_ptr<SafetensorsWriter> w;
  };

  Impl& impl;
  EngineContext& s;
  const std::string dir;
  const std::vector<size_t> order;
  const bool mid, mixed, lead;
  std::exception_ptr write_failure;
  bool writing;
  std::optional<checkpoint::CheckpointWriter> w;
  std::vector<Out> outs;
  size_t fp32_outs = 0;
};

void Engine::check_save_target(const std::string& dir) { checkpoint::check_replaceable(dir); }
void Engine::check_export_target(const std::string& path) { checkpoint::check_writable_file(path); }

void Engine::save(const std::string& whole_dir) {
  Impl::Busy hold(*impl_);
  Impl::CheckpointSave(*impl_, whole_dir).run();
}

}  // namespace strata::parallel
