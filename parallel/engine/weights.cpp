// Engine::export_weights and the weights import at attach
// (EngineOptions::init_weights: a safetensors file or a Hugging Face
// directory): the module's weights in the ecosystem's format.

#include <fmt/format.h>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_set>
#include <unistd.h>

#include "../dispatch/placement.h"
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
  const std::string path = s.tensor_part_file(whole_path);  // Note [Weights across tensor ranks]
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

namespace {

// Note [Importing weights]
// EngineOptions::init_weights names a safetensors file, or a directory in
// Hugging Face's layout (model.safetensors.index.json mapping each tensor to
// its shard, as `strata checkpoint export --hf` and transformers write).
// Each parameter is found by its checkpoint name (EngineOptions::
// checkpoint_name: the model's own under a pipeline), renamed through
// init_weights_names if given, and takes from the file only the elements
// this rank holds: a tensor-parallel part reads its part map's runs
// (Note [Parts of a whole parameter]), so no rank reads a whole tensor it
// holds a part of. Any floating dtype in the file is converted.
class WeightSource {
 public:
  explicit WeightSource(const std::string& path) : path_(path) {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!fs::is_directory(path, ec)) {
      readers_.push_back(std::make_shared<SafetensorsReader>(path));
      for (const auto& t : readers_[0]->header().tensors) where_[t.name] = 0;
      return;
    }
    const std::string index = (fs::path(path) / "model.safetensors.index.json").string();
    STRATA_CHECK(fs::exists(index, ec), path, " is a directory without model.safetensors.index.json: give a "
                 "safetensors file, or a directory in Hugging Face's layout (strata checkpoint export --hf)");
    nlohmann::json j;
    try {
      std::ifstream in(index);
      j = nlohmann::json::parse(in);
      std::map<std::string, size_t> shard;
      for (const auto& [name, file] : j.at("weight_map").items()) {
        const std::string f = file.get<std::string>();
        STRATA_CHECK(f.find('/') == std::string::npos, "shard name ", f, " is not a file name");
        auto [it, fresh] = shard.emplace(f, readers_.size());
        if (fresh) readers_.push_back(nullptr);  // opened when first read
        files_.resize(readers_.size());
        files_[it->second] = (fs::path(path) / f).string();
        where_[name] = it->second;
      }
    } catch (const nlohmann::json::exception& e) {
      STRATA_FAIL(index, ": not a Hugging Face index (", e.what(), ")");
    }
  }
  const std::string& path() const { return path_; }
  size_t size() const { return where_.size(); }
  /// The tensor `name` and its file's reader, or {null, null}.
  std::pair<std::shared_ptr<SafetensorsReader>, const checkpoint::TensorEntry*> find(const std::string& name) {
    const auto it = where_.find(name);
    if (it == where_.end()) return {nullptr, nullptr};
    std::shared_ptr<SafetensorsReader>& r = readers_[it->second];
    if (!r) r = std::make_shared<SafetensorsReader>(files_[it->second]);
    const checkpoint::TensorEntry* e = r->header().find(name);
    STRATA_CHECK(e != nullptr, r->path(), " has no tensor ", name, ", which ", path_,
                 "/model.safetensors.index.json says it holds");
    return {r, e};
  }

 private:
  std::string path_;
  std::vector<std::shared_ptr<SafetensorsReader>> readers_;
  std::vector<std::string> files_;
  std::unordered_map<std::string, size_t> where_;
};

// `names` (a JSON object, model name -> file name; a key ending in '*' maps
// that prefix to the value's, which then ends in '*' too) applied to `name`.
std::string renamed(const nlohmann::json& names, const std::string& name) {
  if (names.contains(name)) return names.at(name).get<std::string>();
  for (const auto& [from, to] : names.items()) {
    const std::string f = from, t = to.get<std::string>();
    if (!f.empty() && f.back() == '*' && !t.empty() && t.back() == '*' && name.rfind(f.substr(0, f.size() - 1), 0) == 0) {
      return t.substr(0, t.size() - 1) + name.substr(f.size() - 1);
    }
  }
  return name;
}

nlohmann::json read_names(const std::string& path) {
  if (path.empty()) return nlohmann::json::object();
  std::ifstream in(path);
  STRATA_CHECK(in.good(), "cannot open the name map ", path, " (EngineOptions::init_weights_names)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    STRATA_FAIL(path, ": not JSON (", e.what(), ")");
  }
  STRATA_CHECK(j.is_object(), path, ": a name map is a JSON object, {\"model name\": \"name in the file\", "
               "\"prefix.*\": \"other.prefix.*\"}");
  for (const auto& [from, to] : j.items()) {
    STRATA_CHECK(!from.empty() && to.is_string(), path, ": the name map's entry \"", from, "\" has no name or no "
                 "string value");
    const std::string t = to.get<std::string>();
    STRATA_CHECK((from.back() == '*') == (!t.empty() && t.back() == '*'), path, ": ", from, " -> ", t,
                 ": a prefix rule ends in '*' on both sides");
  }
  return j;
}

}  // namespace

// Note [Importing weights].
void import_weights(torch::nn::Module& module, const EngineOptions& options) {
  WeightSource src(options.init_weights);
  const nlohmann::json names = read_names(options.init_weights_names);
  const std::string& path = src.path();
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
    const std::string own = options.checkpoint_name ? options.checkpoint_name(item.key()) : item.key();
    tensors[it->second].second.push_back(renamed(names, own));
  }
  for (const auto& [dst, file_names] : tensors) {
    std::shared_ptr<SafetensorsReader> reader;
    const checkpoint::TensorEntry* t = nullptr;
    for (const std::string& name : file_names) {
      std::tie(reader, t) = src.find(name);
      if (t != nullptr) break;
    }
    if (t == nullptr) {
      missing.push_back(file_names.front());
      continue;
    }
    for (const std::string& name : file_names) {
      if (src.find(name).second != nullptr) used.insert(name);  // the other names of a tie are not "extra"
    }
    // This rank's part of the tensor: all of it, or where its layer cut it.
    const std::optional<checkpoint::PartMap> split = tensor_layout::part_map_of(dst);
    const checkpoint::PartMap map = split ? *split : checkpoint::PartMap::whole(shape_of(dst));
    STRATA_CHECK(t->shape == map.whole_shape, reader->path(), ": tensor ", t->name, " is ", shape_str(t->shape),
                 " but the module's parameter is ", shape_str(map.whole_shape),
                 split ? " (whole; this rank holds a part)" : "");
    const torch::ScalarType dtype = torch_dtype(t->dtype);
    const size_t esize = checkpoint::dtype_bytes(t->dtype);
    const auto read = [entry = *t, map, dtype, esize](const SafetensorsReader& from, torch::Tensor& target) {
      const checkpoint::PartMap whole = checkpoint::PartMap::whole(entry.shape);
      torch::Tensor flat = target.view({-1});
      for (const checkpoint::Overlap& o : checkpoint::overlaps(map, 0, map.part_elems(), whole)) {
        torch::Tensor run = torch::empty({o.length}, torch::TensorOptions().dtype(dtype));
        from.read(entry, static_cast<uint64_t>(o.src) * esize, run.data_ptr(), static_cast<size_t>(o.length) * esize);
        flat.narrow(0, o.dst, o.length).copy_(run);
      }
    };
    torch::Tensor target = dst;  // a copy of the handle: copy_ writes the shared tensor
    if (is_lazy(dst)) {
      // Read as attach materialises the parameter into its chunks.
      defer_fill(dst, [reader, read](torch::Tensor& into) { read(*reader, into); });
    } else {
      read(*reader, target);
    }
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < std::min<size_t>(missing.size(), 5); ++i) list += (i ? ", " : "") + missing[i];
    STRATA_FAIL(path, " has no tensor for ", missing.size(), " of the module's parameters (", list,
                missing.size() > 5 ? ", ..." : "", "); the names must match named_parameters(), or give a name map "
                "(EngineOptions::init_weights_names, STRATA_INIT_WEIGHTS_NAMES)");
  }
  const size_t extra = src.size() - used.size();
  if (extra > 0 && options.pipeline_group == nullptr) {  // under a pipeline the other stages take the rest
    STRATA_LOG(kWarn, "{}: {} tensors match no parameter of the module and were ignored", path, extra);
  }
}

}  // namespace strata::parallel
