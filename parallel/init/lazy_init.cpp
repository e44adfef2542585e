#include "strata/parallel/lazy_init.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>

#include "../dispatch/dispatch_keys.h"
#include "../dispatch/deferred_key.h"
#include "strata/core/error.h"
#include "strata/core/log.h"

namespace strata::parallel {

// Note [Replaying initialisers]
// A lazy tensor's storage has no memory: its DataPtr holds a null address and,
// as its context, the LazyRecord of what was done to it (freed with the
// storage). The tensor carries the dispatch key DeferredInit (reserved by
// PyTorch for deferred initialisation, and above autograd), so every operator
// on it reaches lazy_fallback first; while a LazyInit is alive the key is also
// in the thread's included set, so factories reach it too.
//
// - A factory of a floating CPU tensor (empty, zeros, ones, full and their
//   _like and new_ forms) runs on the meta device for its sizes and strides
//   and returns a lazy tensor; ones and full record their fill.
// - An in-place operator on a lazy tensor is recorded as a step: the operator,
//   its arguments, and the view of the storage it wrote through. A random one
//   (its schema takes a Generator) also records a clone of the generator as it
//   was, then runs on a scratch buffer of the same layout with the real
//   generator, so the generator advances exactly as it would have eagerly and
//   later draws (the next parameter, dropout in training) see the same
//   stream. A step that overwrites the whole storage without reading it drops
//   the steps before it (a Linear's kaiming_uniform_ under a later normal_).
// - A view of a lazy tensor (narrow, t, view, detach: whatever the meta
//   device answers with a tensor sharing its input's storage) is another lazy
//   tensor over the same storage.
// - Any other operator reads values: the lazy tensors among its arguments are
//   given memory and their record replayed into it, in place, and it runs.
//
// Replaying zero-fills the memory (what empty's values are is undefined) and
// runs the steps in order, each random one with a clone of its recorded
// generator: the values are those eager construction produced.

namespace {

constexpr c10::DispatchKey kLazyKey = deferred_key::kKey;

struct Step {
  caffe2::TypeMeta dtype;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  std::optional<c10::OperatorHandle> op;
  torch::jit::Stack args;                     // the operator's arguments, self (index 0) left empty
  std::optional<size_t> generator_index;      // a random operator's Generator argument
  std::optional<at::Generator> generator;     // its state before the operator ran
  std::function<void(torch::Tensor&)> fill;   // instead of an operator
};

struct LazyRecord {
  std::vector<Step> steps;
};

void delete_record(void* ctx) { delete static_cast<LazyRecord*>(ctx); }

LazyRecord* record_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const c10::DataPtr& d = t.storage().data_ptr();
  return d.get_deleter() == &delete_record ? static_cast<LazyRecord*>(d.get_context()) : nullptr;
}

// A tensor of `dtype` over `storage` with the given layout (no dispatch through the lazy key).
at::Tensor view_on(const c10::Storage& storage, caffe2::TypeMeta dtype, c10::IntArrayRef sizes,
                   c10::IntArrayRef strides, int64_t offset) {
  c10::impl::ExcludeDispatchKeyGuard no_lazy(kLazyKey);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, offset, sizes, strides);
}

at::Tensor make_lazy(const c10::Storage& storage, caffe2::TypeMeta dtype, c10::IntArrayRef sizes,
                     c10::IntArrayRef strides, int64_t offset) {
  at::Tensor t = view_on(storage, dtype, sizes, strides, offset);
  dispatch_keys::add(t.unsafeGetTensorImpl(), kLazyKey);
  return t;
}

c10::Storage lazy_storage(size_t nbytes) {
  auto* record = new LazyRecord;
  c10::DataPtr data(nullptr, record, &delete_record, c10::Device(c10::kCPU));
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                            std::move(data), nullptr, /*resizable=*/false));
}

// A step writing through `t`'s view of its storage.
Step step_through(const at::Tensor& t) {
  Step s;
  s.dtype = t.dtype();
  s.sizes = t.sizes().vec();
  s.strides = t.strides().vec();
  s.offset = t.storage_offset();
  return s;
}

bool covers_storage(const at::Tensor& t) {
  return t.storage_offset() == 0 && t.is_contiguous() &&
         static_cast<size_t>(t.numel()) * t.element_size() == t.storage().nbytes();
}

// Per thread: LazyInit's nesting, and the buffer random operators run on to
// advance their generators.
struct ThreadState {
  int depth = 0;
  c10::Storage scratch;
};
thread_local ThreadState t_state;

c10::Storage scratch_of(size_t nbytes) {
  if (!t_state.scratch || t_state.scratch.nbytes() < nbytes) {
    t_state.scratch = c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(), false);
  }
  return t_state.scratch;
}

void run_excluded(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_lazy(kLazyKey);
  op.callBoxed(stack);
}

void replay(const LazyRecord& record, const c10::Storage& target) {
  c10::impl::ExcludeDispatchKeyGuard no_lazy(kLazyKey);
  torch::NoGradGuard no_grad;
  std::memset(target.data_ptr().get(), 0, target.nbytes());
  for (const Step& s : record.steps) {
    at::Tensor view = view_on(target, s.dtype, s.sizes, s.strides, s.offset);
    if (s.fill) {
      s.fill(view);
      continue;
    }
    torch::jit::Stack stack = s.args;
    stack[0] = view;
    if (s.generator_index) {
      at::Generator recorded = *s.generator;  // a handle on the same state
      std::lock_guard<std::mutex> lock(recorded.mutex());
      stack[*s.generator_index] = recorded.clone();
    }
    s.op->callBoxed(&stack);
  }
}

// Gives lazy tensor `t`'s storage memory holding its values, in place.
void realise(const at::Tensor& t) {
  if (record_of(t) == nullptr) return;
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  c10::DataPtr old = impl->set_data_ptr(c10::GetCPUAllocator()->allocate(impl->nbytes()));
  impl->set_allocator(c10::GetCPUAllocator());
  replay(*static_cast<LazyRecord*>(old.get_context()), t.storage());
  dispatch_keys::remove(t.unsafeGetTensorImpl(), kLazyKey);
}  // `old` frees the record

using deferred_key::for_each_tensor;

const std::unordered_set<std::string>& factories() {
  static const std::unordered_set<std::string> names{
      "aten::empty",     "aten::empty_strided", "aten::zeros",     "aten::ones",      "aten::full",
      "aten::empty_like", "aten::zeros_like",   "aten::ones_like", "aten::full_like", "aten::new_empty",
      "aten::new_zeros", "aten::new_ones",      "aten::new_full"};
  return names;
}

// Operators that write every element of self without reading it.
const std::unordered_set<std::string>& overwriting() {
  static const std::unordered_set<std::string> names{
      "aten::uniform_",  "aten::normal_",      "aten::fill_",   "aten::zero_",      "aten::copy_",
      "aten::random_",   "aten::exponential_", "aten::cauchy_", "aten::log_normal_", "aten::geometric_",
      "aten::bernoulli_"};
  return names;
}

// Operators that change or read only a tensor's metadata (autograd's, its
// storage's identity): they run on lazy tensors as they are.
const std::unordered_set<std::string>& metadata_only() {
  static const std::unordered_set<std::string> names{
      "aten::set_data",  "aten::data",       "aten::requires_grad_", "aten::retain_grad", "aten::retains_grad",
      "aten::is_leaf",   "aten::output_nr",  "aten::_version",       "aten::set_",        "aten::detach_",
      "aten::as_strided_", "aten::squeeze_", "aten::unsqueeze_",     "aten::t_",          "aten::transpose_",
      "aten::swapdims_", "aten::swapaxes_",  "aten::_has_compatible_shallow_copy_type", "aten::is_same_size",
      "aten::_fw_primal", "aten::_make_dual"};
  return names;
}

// A meta tensor of `t`'s layout (storage extent, sizes, strides, offset).
at::Tensor meta_twin(const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard no_lazy(kLazyKey);
  const int64_t extent = static_cast<int64_t>(t.storage().nbytes() / t.element_size());
  return at::empty({extent}, t.options().device(c10::kMeta)).as_strided(t.sizes(), t.strides(), t.storage_offset());
}

// A factory under LazyInit: a lazy tensor when it makes a floating CPU tensor.
bool lazy_factory(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  if (t_state.depth == 0 || !factories().count(schema.name())) return false;
  const std::string& overload = schema.overload_name();
  if (overload.find("out") != std::string::npos || overload.find("names") != std::string::npos) return false;
  const auto& args = schema.arguments();
  const size_t n = args.size();
  torch::jit::Stack meta(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  std::optional<c10::Device> device;
  std::optional<c10::Scalar> fill;
  for (size_t k = 0; k < n; ++k) {
    const std::string& name = args[k].name();
    c10::IValue& v = meta[k];
    if (name == "device" && !v.isNone()) {
      device = v.toDevice();
    } else if (name == "pin_memory" && !v.isNone() && v.toBool()) {
      return false;
    } else if (name == "fill_value") {
      fill = v.toScalar();
    } else if (v.isTensor()) {
      if (!device) device = v.toTensor().device();
      v = meta_twin(v.toTensor());
    }
  }
  if (device && !device->is_cpu()) return false;
  for (size_t k = 0; k < n; ++k) {
    if (args[k].name() == "device") meta[k] = c10::Device(c10::kMeta);
  }
  run_excluded(op, &meta);
  const at::Tensor shape = meta.at(0).toTensor();
  if (!shape.is_floating_point() || shape.layout() != c10::kStrided) return false;
  const std::string& name = schema.name();
  if (name.find("ones") != std::string::npos) fill = c10::Scalar(1);
  const size_t nbytes = static_cast<size_t>(shape.storage().nbytes());
  at::Tensor lazy = make_lazy(lazy_storage(nbytes), shape.dtype(), shape.sizes(), shape.strides(),
                              shape.storage_offset());
  if (fill) {
    Step s = step_through(lazy);
    s.fill = [v = *fill](torch::Tensor& t) { t.fill_(v); };
    record_of(lazy)->steps.push_back(std::move(s));
  }
  torch::jit::drop(*stack, n);
  stack->emplace_back(std::move(lazy));
  return true;
}

std::optional<size_t> generator_argument(const c10::FunctionSchema& schema) {
  const auto& args = schema.arguments();
  for (size_t k = 0; k < args.size(); ++k) {
    if (args[k].type()->str().find("Generator") != std::string::npos) return k;
  }
  return std::nullopt;
}

// An in-place operator on lazy self (argument 0), other arguments real: recorded.
void record_in_place(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  const at::Tensor self = (*stack)[stack->size() - n].toTensor();
  LazyRecord& record = *record_of(self);
  Step s = step_through(self);
  s.op = op;
  s.args.assign(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  s.args[0] = c10::IValue();  // no reference from the record to its own storage
  s.generator_index = generator_argument(schema);
  if (s.generator_index) {
    const c10::IValue& g = s.args[*s.generator_index];
    at::Generator gen = g.isNone() ? at::detail::getDefaultCPUGenerator() : g.toGenerator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.generator = gen.clone();
    }
    // Advance the generator as running the operator would have.
    torch::jit::Stack advance = s.args;
    advance[0] = view_on(scratch_of(self.storage().nbytes()), self.dtype(), s.sizes, s.strides, s.offset);
    torch::NoGradGuard no_grad;
    run_excluded(op, &advance);
    if (t_state.depth == 0) t_state.scratch = c10::Storage();
  }
  if (overwriting().count(schema.name()) && covers_storage(self)) record.steps.clear();
  record.steps.push_back(std::move(s));
  torch::jit::drop(*stack, n);
  if (!schema.returns().empty()) stack->emplace_back(self);
}

// A view of lazy tensors: lazy tensors over the same storage. The meta
// device answers whether the operator is a view (each output over an input's
// storage); if so it runs on the lazy tensors themselves, which reads no
// values, so autograd records the view as it would eagerly. False otherwise.
bool lazy_view(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  if (schema.returns().empty()) return false;
  for (const c10::Argument& r : schema.returns()) {
    if (r.alias_info() == nullptr) return false;
  }
  const size_t n = schema.arguments().size();
  torch::jit::Stack meta(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  std::vector<at::Tensor> twins;
  for (c10::IValue& v : meta) {
    if (v.isTensor() && record_of(v.toTensor()) != nullptr) {
      v = meta_twin(v.toTensor());
      twins.push_back(v.toTensor());
    }
  }
  try {
    run_excluded(op, &meta);
  } catch (const std::exception& e) {
    STRATA_LOG(kDebug, "lazy init: {} has no meta kernel: {}", schema.name(), e.what());
    return false;  // run it on real memory
  }
  bool views = true;
  for (const c10::IValue& r : meta) {
    for_each_tensor(r, [&](const at::Tensor& m) {
      bool shares = false;
      for (const at::Tensor& twin : twins) {
        shares = shares || m.storage().unsafeGetStorageImpl() == twin.storage().unsafeGetStorageImpl();
      }
      views = views && m.is_meta() && shares;
    });
  }
  if (!views) return false;
  run_excluded(op, stack);
  for (size_t k = stack->size() - meta.size(); k < stack->size(); ++k) {
    for_each_tensor((*stack)[k], [](const at::Tensor& t) { dispatch_keys::add(t.unsafeGetTensorImpl(), kLazyKey); });
  }
  return true;
}

// Activation collection, outside lazy construction: the operator runs below
// this key, so the operators it calls come back here and are seen too.
void collect_around(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  deferred_key::saw_arguments(*stack, n);
  const size_t below = stack->size() - n;
  try {
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kLazyKey), stack);
  } catch (...) {
    deferred_key::saw_failure();
    throw;
  }
  deferred_key::saw_results(*stack, stack->size() - below);
}

void lazy_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  if (lazy_factory(op, stack)) return;
  std::vector<size_t> lazy_args;
  bool lazy_in_list = false;
  for (size_t k = 0; k < n; ++k) {
    const c10::IValue& v = (*stack)[stack->size() - n + k];
    if (v.isTensor()) {
      if (record_of(v.toTensor()) != nullptr) lazy_args.push_back(k);
    } else {
      for_each_tensor(v, [&](const at::Tensor& t) { lazy_in_list = lazy_in_list || record_of(t) != nullptr; });
    }
  }
  if (lazy_args.empty() && !lazy_in_list) {
    // Lazy construction runs operators with the key excluded: kernels that
    // make temporaries must get memory, not lazy tensors.
    if (t_state.depth == 0 && deferred_key::collecting()) return collect_around(op, keys, stack);
    return run_excluded(op, stack);
  }
  if (metadata_only().count(schema.name())) return run_excluded(op, stack);
  const auto& args = schema.arguments();
  const auto writes = [&](size_t k) { return args[k].alias_info() != nullptr && args[k].alias_info()->isWrite(); };
  bool writes_other = false;
  for (size_t k = 1; k < n; ++k) writes_other = writes_other || writes(k);
  const bool in_place = n > 0 && writes(0) && !lazy_args.empty() && lazy_args[0] == 0 && !writes_other;
  if (in_place) {
    for (size_t k = 1; k < n; ++k) for_each_tensor((*stack)[stack->size() - n + k], realise);
    return record_in_place(op, stack);
  }
  if (!writes_other && (n == 0 || !writes(0)) && lazy_view(op, stack)) return;
  STRATA_LOG(kDebug, "lazy init: {} reads a lazy tensor's values; it is materialised", schema.name());
  for (size_t k = 0; k < n; ++k) for_each_tensor((*stack)[stack->size() - n + k], realise);
  run_excluded(op, stack);
}

}  // namespace

void deferred_key::register_fallback() { dispatch_keys::register_fallback_once<&lazy_fallback>(kLazyKey); }

struct LazyInit::Guard {
  c10::impl::IncludeDispatchKeyGuard include{kLazyKey};
};

LazyInit::LazyInit() {
  deferred_key::register_fallback();
  guard_ = std::make_unique<Guard>();
  ++t_state.depth;
}

LazyInit::~LazyInit() {
  guard_.reset();
  if (--t_state.depth == 0) t_state.scratch = c10::Storage();
}

bool is_lazy(const torch::Tensor& t) { return record_of(t) != nullptr; }

torch::Tensor materialized_copy(const torch::Tensor& t) {
  const LazyRecord* record = record_of(t);
  if (record == nullptr) return t;
  c10::Storage memory(c10::Storage::use_byte_size_t(), t.storage().nbytes(), c10::GetCPUAllocator(), false);
  replay(*record, memory);
  return view_on(memory, t.dtype(), t.sizes(), t.strides(), t.storage_offset());
}

void materialize(const torch::Tensor& t) { realise(t); }

void materialize(torch::nn::Module& module) {
  for (const torch::Tensor& p : module.parameters(/*recurse=*/true)) realise(p);
  for (const torch::Tensor& b : module.buffers(/*recurse=*/true)) realise(b);
}

void defer_fill(const torch::Tensor& t, std::function<void(torch::Tensor&)> fill) {
  LazyRecord* record = record_of(t);
  STRATA_CHECK(record != nullptr, "defer_fill: the tensor is not lazy (it has memory already)");
  if (covers_storage(t)) record->steps.clear();
  Step s = step_through(t);
  s.fill = std::move(fill);
  record->steps.push_back(std::move(s));
}

}  // namespace strata::parallel
