// Engine::save: Note [Saving a checkpoint] and Note [Checkpoints across ranks]
// (checkpoint_format.h), in the order a save runs: open the tensor files,
// stream the families into them, the module state, the RNG states, state.json
// and the commit, then the ranks' agreement on whether it worked.
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "../zero/sharding.h"
#include "checkpoint_format.h"
#include "engine_impl.h"
#include "family_stream.h"
#include "tensor_files.h"
#include "strata/checkpoint/checkpoint_dir.h"
#include "strata/checkpoint/convert.h"
#include "strata/checkpoint/safetensors.h"

namespace strata::parallel {

using checkpoint::SafetensorsWriter;
using json = nlohmann::json;

namespace {

// Buffers and frozen parameters as they were before attach cast them: on CPU, contiguous.
torch::Tensor state_value(const torch::Tensor& tensor, torch::ScalarType original) {
  return tensor.detach().to(torch::kCPU, original).contiguous();
}

}  // namespace

struct Engine::Impl::CheckpointSave {
  // `weights_only`: the fp32 values alone, and state.json (Engine::export_hf);
  // `after_commit(dir)` runs on the lead once the checkpoint is in place,
  // its failure every rank's, as a write's.
  CheckpointSave(Impl& engine, const std::string& checkpoint_dir, bool weights_only = false,
                 std::function<void(const std::string&)> after_commit = nullptr)
      : impl(engine),
        s(engine.ctx),
        dir(checkpoint_dir),
        tensor(s.tensor_group != nullptr && s.tensor_group->world_size() > 1 ? s.tensor_group : nullptr),
        pipe(s.options.pipeline_group != nullptr && s.options.pipeline_group->world_size() > 1
                 ? s.options.pipeline_group.get()
                 : nullptr),
        tensor_size(tensor ? tensor->world_size() : 1),
        parts(tensor_size * (pipe ? pipe->world_size() : 1)),
        part((pipe ? pipe->rank() : 0) * tensor_size + (tensor ? tensor->rank() : 0)),
        order(params_in_chunk_order(s)),
        weights(weights_only),
        then(std::move(after_commit)),
        mid(!weights_only && engine.micro_steps % s.options.grad_accumulation != 0),
        mixed(s.options.precision != DType::kFloat32),
        writer(s.rank == 0),
        lead(writer && part == 0),
        writing(writer) {}

  void run() {
    STRATA_CHECK(impl.poisoned.empty(), impl.poisoned);
    STRATA_CHECK(!mid || !s.data_parallel(), "save() after micro-step ",
                 impl.micro_steps % s.options.grad_accumulation, " of ", s.options.grad_accumulation,
                 ": data parallel gradients mid-accumulation are each rank's own; save on an accumulation boundary");
    // Note [Tied parameters across stages]: each copy's gradient is its own stage's until the boundary sums them.
    STRATA_CHECK(!mid || !s.stages_tied, "save() after micro-step ", impl.micro_steps % s.options.grad_accumulation,
                 " of ", s.options.grad_accumulation, ": a parameter tied across pipeline stages has a partial "
                 "gradient on each stage until the accumulation ends, and a checkpoint holds one; save on an "
                 "accumulation boundary");
    check_tensor_groups();
    if (writer) {
      choose_pieces();
      open_staging();
      if (writing) try {
        open_outputs();
      } catch (...) {
        failed();
      }
    }
    write_families();
    if (writing && !impl.module_state.empty() && (tensor == nullptr || tensor->rank() == 0)) try {
      write_module_state();
    } catch (...) {
      failed();
    }
    const std::vector<std::pair<std::string, std::string>> rng =
        weights ? std::vector<std::pair<std::string, std::string>>{} : rng_states();
    if (writing) try {
      finish_part(rng);
    } catch (...) {
      failed();
    }
    if (writer) gather_and_commit();
    agree();
  }

 private:
  // A rank's write failure must not leave the others waiting in the next
  // collective: it records it, keeps taking part, and every rank learns of
  // it at the end (agree()). Called in a catch block; one process rethrows
  // at once.
  void failed() {
    if (s.world() == 1 && parts == 1) throw;
    if (!write_failure) write_failure = std::current_exception();
    writing = false;
  }

  // A part's number comes from its tensor and pipeline ranks, so every stage
  // must know its tensor group (a stage whose layers split nothing does not).
  void check_tensor_groups() const {
    if (pipe == nullptr) return;
    const std::vector<double> sizes = all_gather_values(*pipe, {static_cast<double>(tensor_size)});
    for (size_t r = 0; r < sizes.size(); ++r) {
      STRATA_CHECK(static_cast<int>(sizes[r]) == tensor_size, "pipeline rank ", r, "'s stages split parameters over ",
                   sizes[r], " tensor ranks, pipeline rank ", pipe->rank(), "'s over ", tensor_size,
                   ": a checkpoint numbers its parts by tensor and pipeline rank, so every stage needs a "
                   "tensor-parallel layer of the same group (or none at all)");
    }
  }

  // Note [Checkpoints across layouts]: ranks of a tensor group holding the
  // same part (a replicated bias, a 2D norm's block on every row, a 2.5D
  // weight on every depth) save it once, the lowest tensor rank holding it;
  // so do the pipeline stages holding a tied parameter (Note [Tied
  // parameters across stages]), the lowest pipeline rank.
  void choose_pieces() {
    writes.assign(s.params.size(), true);
    json mine = json::array();
    for (size_t i : order) mine.push_back({s.params[i].whole_name, part_map_json(s.params[i].part)});
    std::set<std::string> lower;
    const auto held_below = [&](Communicator* group) {
      if (group == nullptr) return;
      const std::vector<std::string> all = all_gather_strings(*group, mine.dump());
      for (int r = 0; r < group->rank(); ++r) {
        for (const json& e : json::parse(all[static_cast<size_t>(r)])) lower.insert(e.dump());
      }
    };
    held_below(tensor);
    if (s.stages_tied) held_below(pipe);  // the same on every stage (tied_params.h)
    for (size_t k = 0; k < order.size(); ++k) writes[order[k]] = lower.count(mine[k].dump()) == 0;
  }

  // The lead (part 0's data rank 0) makes the temporary directory every
  // writer puts its files in; the others learn where it is.
  void open_staging() {
    std::string staging;
    if (lead) try {
      w.emplace(dir, kEngineCheckpointKind);
      staging = w->staging_dir();
    } catch (...) {
      failed();
    }
    // Along the pipeline among tensor rank 0's, then along each tensor group.
    if (pipe != nullptr && (tensor == nullptr || tensor->rank() == 0)) staging = all_gather_strings(*pipe, staging)[0];
    if (tensor != nullptr) staging = all_gather_strings(*tensor, staging)[0];
    if (staging.empty()) writing = false;  // the lead could not start: it says why
    staging_dir = staging;
  }

  std::string path(const std::string& file) const { return staging_dir + "/" + file; }

  void open_outputs() {
    std::vector<SafetensorsWriter::Spec> fp32, compute;
    for (size_t i : order) {
      if (!writes[i]) continue;
      fp32.push_back({s.params[i].whole_name, "F32", shape_of(s.params[i].tensor)});
      compute.push_back({s.params[i].whole_name, st_dtype(s.options.precision), shape_of(s.params[i].tensor)});
    }
    const std::vector<std::string> state_names = s.optimizer.state_names();
    fp32_outs = 1 + state_names.size();  // the fp32 values and each optimizer state
    auto add = [&](const std::string& stem, const std::vector<SafetensorsWriter::Spec>& specs,
                   std::map<std::string, std::string> metadata = {}) {
      const std::string file = part_file(stem, part, parts);
      outs.push_back({file, std::make_unique<SafetensorsWriter>(path(file), specs, std::move(metadata))});
    };
    add("master", fp32, {{"format", "pt"}});
    if (weights) {
      fp32_outs = 1;
      return;
    }
    for (const std::string& state : state_names) add(state, fp32);
    if (mixed) add("param", compute);
    if (mid) add("grad", compute);
  }

  // What is written per family: the fp32 values, the optimizer state
  // (exp_avg and exp_avg_sq for Adam), the compute copy (mixed precision)
  // and gradients (mid-accumulation).
  std::vector<ChunkId> members(memory::FamilyId f) const {
    const memory::ChunkFamily& fam = s.mgr->family(f);
    std::vector<ChunkId> chunks = {fam.master ? *fam.master : s.step_param(f)};
    if (weights) return chunks;
    chunks.insert(chunks.end(), fam.optim_states.begin(), fam.optim_states.end());
    if (mixed) chunks.push_back(s.step_param(f));
    if (mid) chunks.push_back(fam.grad);
    return chunks;
  }

  // Family by family; sharded members are gathered whole while their family
  // is pinned (every rank of the data group takes part).
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
          if (!writing || !writes[static_cast<size_t>(&p - s.params.data())]) return;
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

  void record(const std::string& file, uint64_t bytes, uint64_t checksum) {
    files.push_back({{"name", file}, {"bytes", bytes}, {"xxh3_64", checkpoint::hex64(checksum)}});
  }

  // Buffers and frozen parameters (rank 0's of each stage, as DDP keeps them): one small file.
  void write_module_state() {
    std::vector<SafetensorsWriter::Spec> specs;
    auto name_of = [&](const std::string& n) { return s.options.checkpoint_name ? s.options.checkpoint_name(n) : n; };
    for (const auto& m : impl.module_state) specs.push_back({name_of(m.name), st_dtype_of(m.original), shape_of(m.tensor)});
    module_state_file = part_file("module_state", part, parts);
    SafetensorsWriter sw(path(module_state_file), specs);
    for (const auto& m : impl.module_state) {
      const torch::Tensor v = state_value(m.tensor, m.original);
      sw.append(v.data_ptr(), static_cast<size_t>(v.numel()) * v.element_size());
    }
    sw.finish();
    record(module_state_file, sw.bytes(), sw.checksum());
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
      const std::vector<std::string> all = s.data_parallel() ? all_gather_strings(*s.comm, mine) : std::vector{mine};
      for (size_t r = 0; r < all.size(); ++r) {
        states.emplace_back(rng_file(stem, static_cast<int>(r), part, parts), all[r]);
      }
    }
    return states;
  }

  // This writer's files finished, and what they hold.
  void finish_part(const std::vector<std::pair<std::string, std::string>>& rng_states) {
    for (Out& o : outs) {
      o.w->finish();
      record(o.name, o.w->bytes(), o.w->checksum());
    }
    for (const auto& [file, bytes] : rng_states) {
      checkpoint::FileWriter fw(path(file));
      fw.write(bytes.data(), bytes.size());
      fw.finish();
      record(file, fw.bytes(), fw.checksum());
      rng.push_back(file);
    }
    for (size_t i : order) {
      if (!writes[i]) continue;
      const ManagedParam& p = s.params[i];
      params.push_back({{"name", p.whole_name}, {"steps", p.steps}, {"has_grad", p.has_grad},
                        {"map", part_map_json(p.part)}});
    }
  }

  // Every writer's files and pieces reach the lead (along each tensor group,
  // then along the pipeline among tensor rank 0's), which writes state.json
  // and commits when every part was written.
  void gather_and_commit() {
    json mine = {{"ok", writing}, {"files", files}, {"params", params}, {"rng", rng},
                 {"module_state", module_state_file}};
    std::vector<json> got = {mine};
    if (tensor != nullptr) {
      got.clear();
      for (const std::string& t : all_gather_strings(*tensor, mine.dump())) got.push_back(json::parse(t));
    }
    if (pipe != nullptr && (tensor == nullptr || tensor->rank() == 0)) {
      const std::vector<std::string> all = all_gather_strings(*pipe, json(got).dump());
      got.clear();
      for (const std::string& t : all) {
        for (json& j : json::parse(t)) got.push_back(std::move(j));
      }
    }
    if (!lead || !w) return;
    try {
      for (const json& g : got) STRATA_CHECK(g.at("ok").get<bool>(), "a rank could not write its part of checkpoint ", dir);
      write_state_and_commit(got);
    } catch (...) {
      failed();
    }
  }

  void write_state_and_commit(const std::vector<json>& got) {
    json rng_files = json::array(), module_files = json::array();
    std::map<std::string, json> by_name;  // a parameter's entry, its pieces from every part
    std::vector<std::string> names;
    for (size_t k = 0; k < got.size(); ++k) {
      for (const json& f : got[k].at("files")) {
        w->add(f.at("name"), f.at("bytes").get<uint64_t>(), std::stoull(f.at("xxh3_64").get<std::string>(), nullptr, 16));
      }
      for (const json& r : got[k].at("rng")) rng_files.push_back(r);
      if (!got[k].at("module_state").get<std::string>().empty()) module_files.push_back(got[k].at("module_state"));
      for (const json& p : got[k].at("params")) {
        const std::string name = p.at("name");
        auto [it, fresh] = by_name.try_emplace(name, json{{"name", name}, {"shape", p.at("map").at("whole_shape")},
                                                         {"steps", p.at("steps")}, {"has_grad", p.at("has_grad")},
                                                         {"pieces", json::array()}});
        if (fresh) names.push_back(name);
        it->second["pieces"].push_back({{"part", static_cast<int>(k)}, {"map", p.at("map")}});
      }
    }
    json list = json::array();
    for (const std::string& n : names) list.push_back(by_name.at(n));
    json state = {{"format", "strata-engine-state"},
                        {"precision", dtype_name(s.options.precision)},
                        {"grad_accumulation", s.options.grad_accumulation},
                        {"micro_steps", impl.micro_steps},
                        {"loss_scale", impl.pipeline->loss_scale()},
                        {"clean_steps", impl.pipeline->clean_steps()},
                        {"skipped_steps", impl.pipeline->skipped()},
                        {"world_size", s.world()},
                        {"zero_stage", s.stage},
                        {"layout", {{"tensor", tensor_size}, {"pipeline", parts / tensor_size}}},
                        {"optimizer", optimizer_state(s, impl.pipeline->optimizer_steps())},
                        {"rng", rng_files},
                        {"module_state", module_files},
                        {"parameters", list}};
    // Note [Updates in backward]: the norm the next step clips by.
    if (const std::optional<double> norm = impl.pipeline->previous_grad_norm()) state["previous_grad_norm"] = *norm;
    if (s.options.update_in_backward && !impl.pipeline->gradient_arrivals().empty()) {
      state["gradient_arrivals"] = impl.pipeline->gradient_arrivals();
    }
    w->write_text("state.json", state.dump(1) + "\n");
    w->commit();
    if (then) then(dir);
  }

  // Nobody returns (and perhaps loads) before the checkpoint is in place,
  // and every rank fails when a writer could not write it: the failure flag
  // is summed over the data group, then the tensor group, then the
  // pipeline, which together reach every rank.
  void agree() {
    if (s.world() == 1 && parts == 1) return;
    float any_failed = write_failure ? 1.0f : 0.0f;
    for (Communicator* g : {s.data_parallel() ? s.comm.get() : nullptr, tensor, pipe}) {
      if (g != nullptr) g->all_reduce(&any_failed, 1, DType::kFloat32, ReduceOp::kMax)->wait();
    }
    if (write_failure) std::rethrow_exception(write_failure);
    STRATA_CHECK(any_failed == 0.0f, parts == 1 ? "rank 0 could not write checkpoint " : "a rank could not write "
                 "its part of checkpoint ", dir, " (its error says why); the previous checkpoint there, if any, is "
                 "unchanged");
  }

  struct Out {
    std::string name;
    std::unique_ptr<SafetensorsWriter> w;
  };

  Impl& impl;
  EngineContext& s;
  const std::string dir;
  Communicator* const tensor;  // null: no tensor parallelism
  Communicator* const pipe;    // null: no pipeline
  const int tensor_size, parts, part;
  const std::vector<size_t> order;
  const bool weights;
  const std::function<void(const std::string&)> then;
  const bool mid, mixed, writer, lead;
  std::exception_ptr write_failure;
  bool writing;
  std::vector<bool> writes;  // by parameter: this rank saves its part
  std::optional<checkpoint::CheckpointWriter> w;  // the lead's
  std::string staging_dir, module_state_file;
  std::vector<Out> outs;
  size_t fp32_outs = 0;
  json files = json::array(), params = json::array(), rng = json::array();
};

void Engine::check_save_target(const std::string& dir) { checkpoint::check_replaceable(dir); }
void Engine::check_export_target(const std::string& path) { checkpoint::check_writable_file(path); }

void Engine::save(const std::string& dir) {
  Impl::Busy hold(*impl_);
  Impl::CheckpointSave(*impl_, dir).run();
}

// Note [Exporting weights from any layout]: the parts' fp32 values go to a
// weights-only checkpoint beside `dir` (every writer its parts, as save()
// writes them), from which the lead writes Hugging Face's layout at `dir`,
// streamed and atomically (Note [Exporting a checkpoint in Hugging Face's
// layout]), and removes it; every rank then learns whether all of it worked.
void Engine::export_hf(const std::string& dir, uint64_t shard_bytes, DType dtype) {
  Impl::Busy hold(*impl_);
  STRATA_CHECK(shard_bytes > 0, "export_hf: the shard size must be more than 0");
  checkpoint::check_replaceable(dir);  // on every rank, before any collective
  Impl::CheckpointSave(*impl_, dir + ".parts", /*weights_only=*/true, [&](const std::string& parts) {
    checkpoint::export_hf(parts, dir, shard_bytes, dtype);
    std::error_code ec;
    std::filesystem::remove_all(parts, ec);
  }).run();
}

}  // namespace strata::parallel
