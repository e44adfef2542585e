// Engine::export_weights and the safetensors import at attach
// (EngineOptions::init_weights): the module's weights in the ecosystem's format.

#include <fmt/format.h>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <optional>
#include <unistd.h>

#include "engine_impl.h"
#include "family_stream.h"
#include "strata/checkpoint/files.h"
#include "strata/checkpoint/safetensors.h"
#include "strata/parallel/lazy_init.h"
#include "tensor_files.h"

namespace strata::parallel {

using checkpoint::SafetensorsReader;
using checkpoint::SafetensorsWriter;

// Collective when data parallel: rank 0 writes (Note [Checkpoints across ranks]).
void Engine::export_weights(const std::string& whole_path) {
  Impl& impl = *impl_;
  Impl::Busy hold(impl);
  EngineContext& s = impl.ctx;
  const std::string path = s.tensor_part_file(whole_path);  // Note [Checkpoints across tensor ranks]
  STRATA_CHECK(impl.poisoned.empty(), impl.poisoned);
  const bool lead = s.rank == 0;
  const std::vector<size_t> order = params_in_chunk_order(s);
  std::vector<SafetensorsWriter::Spec> specs;
  for (size_t i : order) specs.push_back({s.params[i].name, "F32", shape_of(s.params[i].tensor)});
  for (const auto& [name, t] : impl.frozen) specs.push_back({name, "F32", shape_of(t)});
  // Written beside `path` and renamed over it: a reader never sees half a
  // file. Data parallel, a write failure on rank 0 is recorded while it keeps
  // taking part in the gathers, and every rank learns of it at the end (as
  // in save()).
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  std::exception_ptr write_failure;
  bool writing = lead;
  std::optional<SafetensorsWriter> w;
  const auto write = [&](const std::function<void()>& fn) {
    if (!writing) return;
    try {
      fn();
    } catch (...) {
      std::remove(tmp.c_str());
      if (!s.data_parallel()) throw;
      write_failure = std::current_exception();
      writing = false;
    }
  };
  write([&] { w.emplace(tmp, specs, std::map<std::string, std::string>{{"format", "pt"}}); });
  size_t next = 0;
  for (memory::FamilyId f : s.families) {
    const std::vector<float> values = family_values(s, f);  // one family at a time, gathered when sharded
    for (; next < order.size() && s.params[order[next]].family == f; ++next) {
      const ManagedParam& p = s.params[order[next]];
      write([&] { w->append(values.data() + p.offset, static_cast<size_t>(p.numel) * sizeof(float)); });
    }
  }
  write([&] {
    for (const auto& [name, t] : impl.frozen) {
      const torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
      w->append(c.data_ptr(), static_cast<size_t>(c.numel()) * sizeof(float));
    }
    w->finish();
    STRATA_SYSCALL(::rename(tmp.c_str(), path.c_str()), "cannot rename ", tmp, " to ", path);
    // The rename is durable only once the directory entry is on disk.
    checkpoint::sync_directory(std::filesystem::absolute(path).parent_path().string());
  });
  if (s.data_parallel()) {
    float rank0_failed = write_failure ? 1.0f : 0.0f;
    s.comm->all_reduce(&rank0_failed, 1, DType::kFloat32, ReduceOp::kMax)->wait();
    if (write_failure) std::rethrow_exception(write_failure);
    STRATA_CHECK(rank0_failed == 0.0f, "rank 0 could not write the weights to ", path, " (its error says why)");
  }
}

// Copies the tensors of a safetensors file into `module`'s parameters by name.
void import_weights(torch::nn::Module& module, const std::string& path) {
  SafetensorsReader r(path);
  std::shared_ptr<SafetensorsReader> shared;  // for lazy parameters, read later
  std::vector<std::string> missing;
  std::unordered_set<std::string> used;
  torch::NoGradGuard no_grad;
  // Tied parameters (one tensor under several names) are written once, under
  // the first name (export_weights, as Hugging Face's safetensors export
  // does): any one of a tensor's names in the file gives it its values.
  std::vector<std::pair<torch::Tensor, std::vector<std::string>>> tensors;
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const auto [it, fresh] = index.emplace(item.value().unsafeGetTensorImpl(), tensors.size());
    if (fresh) tensors.push_back({item.value(), {}});
    tensors[it->second].second.push_back(item.key());
  }
  for (const auto& [dst, names] : tensors) {
    const checkpoint::TensorEntry* t = nullptr;
    for (const std::string& name : names) {
      if ((t = r.header().find(name)) != nullptr) {
        used.insert(name);
        break;
      }
    }
    if (t == nullptr) {
      missing.push_back(names.front());
      continue;
    }
    for (const std::string& name : names) {
      if (r.header().find(name) != nullptr) used.insert(name);  // the other names of a tie are not "extra"
    }
    STRATA_CHECK(t->shape == shape_of(dst), path, ": tensor ", t->name, " is ", shape_str(t->shape),
                 " but the module's parameter is ", shape_str(shape_of(dst)));
    const auto read = [entry = *t](SafetensorsReader& from, torch::Tensor& target) {
      torch::Tensor src = torch::empty(entry.shape, torch::TensorOptions().dtype(torch_dtype(entry.dtype)));
      from.read(entry, 0, src.data_ptr(), entry.end - entry.begin);
      target.copy_(src);
    };
    torch::Tensor target = dst;  // a copy of the handle: copy_ writes the shared tensor
    if (is_lazy(dst)) {
      // Read as attach materialises the parameter into its chunks, through
      // one reader for the file (its header parsed once).
      if (!shared) shared = std::make_shared<SafetensorsReader>(path);
      defer_fill(dst, [shared, read](torch::Tensor& into) { read(*shared, into); });
    } else {
      read(r, target);
    }
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
