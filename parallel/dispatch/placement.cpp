// Which parameters tensor parallelism split, over which group, and how many
// ranks hold each copy (tensor_group_of, tensor_copies_of); and the
// dispatcher fallback that runs operators on parallelize()'s parameters in
// their tensor-parallel form (Note [Tensor-parallel operators on unmodified
// modules] in placement.h). Built without a communicator backend, since the
// engine asks it whatever the build.
#include "placement.h"

#include <ATen/ATen.h>

#include <mutex>
#include <unordered_map>

#include "strata/core/error.h"
#include "strata/parallel/tensor_parallel.h"
#include "dispatch_keys.h"
#include "../torch_compat.h"

namespace strata::parallel {

namespace tensor_layout {

namespace {

constexpr c10::DispatchKey kLayoutKey = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;  // tells a live parameter from a new tensor at a reused address
  Communicator* group = nullptr;
  int copies = 1;
  std::shared_ptr<const Placement> placement;
  std::shared_ptr<const checkpoint::PartMap> map;  // where the part lies in the whole; null: not said
  bool transposed = false;  // aten::t of a placed parameter (LibTorch 1.13's F::linear), not a parameter itself
};

struct SplitTensors {
  std::mutex mu;
  std::unordered_map<const c10::TensorImpl*, Entry> entries;
};
SplitTensors& split_tensors() {
  static auto* r = new SplitTensors;  // never destroyed: static destructors may still run operators
  return *r;
}

// The live entry of `t`, or null. Callers hold the registry's lock.
const Entry* find_locked(const at::Tensor& t) {
  if (!t.defined()) return nullptr;
  const auto it = split_tensors().entries.find(t.unsafeGetTensorImpl());
  if (it == split_tensors().entries.end() || it->second.tensor.lock().get() != t.unsafeGetTensorImpl()) return nullptr;
  return &it->second;
}

void forget_expired_locked() {
  for (auto it = split_tensors().entries.begin(); it != split_tensors().entries.end();) {
    it = it->second.tensor.expired() ? split_tensors().entries.erase(it) : std::next(it);
  }
}

bool is_op(const c10::OperatorHandle& op, const char* name) {
  return op.schema().name() == name && op.schema().overload_name().empty();
}

// Argument `arg` of the `n` on top of the stack, when it is a placed tensor: its entry (copied).
c10::optional<Entry> placed_arg(const torch::jit::Stack& stack, size_t n, size_t arg) {
  const c10::IValue& v = stack[stack.size() - n + arg];
  if (!v.isTensor()) return c10::nullopt;
  std::lock_guard<std::mutex> lock(split_tensors().mu);
  const Entry* e = find_locked(v.toTensor());
  if (e == nullptr || e->placement == nullptr) return c10::nullopt;
  return *e;
}

std::vector<c10::IValue> take_args(torch::jit::Stack* stack, size_t n) {
  std::vector<c10::IValue> args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  torch::jit::drop(*stack, n);
  return args;
}

c10::optional<at::Tensor> optional_tensor(const c10::IValue& v) {
  return v.isTensor() ? c10::optional<at::Tensor>(v.toTensor()) : c10::nullopt;
}

bool is_one(const c10::IValue& v) { return v.isNone() || v.toScalar().equal(1); }

// The tensor-parallel form of `op`, pushed on the stack; false: none (the stack is untouched).
bool run_placed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  if (is_op(op, "aten::t")) {  // remember W.t() as the transposed weight
    const c10::optional<Entry> e = placed_arg(*stack, n, 0);
    if (!e || e->transposed) return false;
    op.callBoxed(stack);
    const at::Tensor t = stack->back().toTensor();
    std::lock_guard<std::mutex> lock(split_tensors().mu);
    forget_expired_locked();
    split_tensors().entries.insert_or_assign(t.unsafeGetTensorImpl(),
                                        Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), e->group,
                                              e->copies, e->placement, nullptr, true});
    return true;
  }
  c10::optional<at::Tensor> out;
  if (is_op(op, "aten::linear")) {
    const c10::optional<Entry> e = placed_arg(*stack, n, 1);
    if (!e || e->transposed) return false;
    const std::vector<c10::IValue> a = take_args(stack, n);
    const at::Tensor w = a[1].toTensor();
    out = e->placement->linear(a[0].toTensor(), [&] { return w; }, [&](const at::Tensor& x) { return at::linear(x, w); },
                               optional_tensor(a[2]));
    STRATA_CHECK(out.has_value(), "a tensor-parallel parameter of this layout cannot be a linear layer's weight");
  } else if (is_op(op, "aten::addmm") || is_op(op, "aten::matmul")) {
    const bool addmm = op.schema().name() == "aten::addmm";
    const c10::optional<Entry> e = placed_arg(*stack, n, addmm ? 2 : 1);
    if (!e || !e->transposed) return false;
    const std::vector<c10::IValue> a = take_args(stack, n);
    const at::Tensor x = a[addmm ? 1 : 0].toTensor(), wt = a[addmm ? 2 : 1].toTensor();
    STRATA_CHECK(!addmm || (is_one(a[3]) && is_one(a[4])), "addmm with beta or alpha other than 1 on a "
                 "tensor-parallel weight: use a linear layer (F::linear) on it");
    out = e->placement->linear(x, [&] { return wt.t(); }, [&](const at::Tensor& v) { return at::matmul(v, wt); },
                               addmm ? optional_tensor(a[0]) : c10::nullopt);
    STRATA_CHECK(out.has_value(), "a tensor-parallel parameter of this layout cannot be a linear layer's weight");
  } else if (is_op(op, "aten::layer_norm")) {
    const c10::optional<Entry> e = placed_arg(*stack, n, 2);
    if (!e || e->transposed) return false;
    const std::vector<c10::IValue> a = take_args(stack, n);
    std::vector<int64_t> shape;
    for (const c10::IValue& v : a[1].toListRef()) shape.push_back(torch_compat::int_arg(v));
    out = e->placement->layer_norm(a[0].toTensor(), shape, a[2].toTensor(), optional_tensor(a[3]), a[4].toDouble());
    STRATA_CHECK(out.has_value(), "a tensor-parallel parameter of this layout cannot be a norm's weight");
  } else if ((op.schema().name() == "aten::add" || op.schema().name() == "aten::add_") &&
             op.schema().overload_name() == "Tensor") {
    const c10::optional<Entry> e = placed_arg(*stack, n, 1);
    if (!e || e->transposed) return false;
    const bool in_place = op.schema().name() == "aten::add_";
    std::vector<c10::IValue> a = take_args(stack, n);
    out = e->placement->add(a[0].toTensor(), a[1].toTensor(), a[2].toScalar(), in_place);
    if (!out.has_value()) {  // no form of its own: the operator as it is
      for (c10::IValue& v : a) torch::jit::push(*stack, std::move(v));
      return false;
    }
  } else if (is_op(op, "aten::embedding")) {
    const c10::optional<Entry> e = placed_arg(*stack, n, 0);
    if (!e || e->transposed) return false;
    const std::vector<c10::IValue> a = take_args(stack, n);
    const int64_t padding = torch_compat::int_arg(a[2]);
    out = e->placement->embedding(a[0].toTensor(), a[1].toTensor(), padding, a[3].toBool(), a[4].toBool());
    STRATA_CHECK(out.has_value(), "a tensor-parallel parameter of this layout cannot be an embedding table");
  } else {
    return false;
  }
  torch::jit::push(*stack, *out);
  return true;
}

// Note [Tensor-parallel operators on unmodified modules].
void layout_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard exclude(kLayoutKey);
  if (!run_placed(op, stack)) op.callBoxed(stack);
}

}  // namespace

void place(const at::Tensor& param, Communicator& group, int copies, std::shared_ptr<const Placement> placement,
           std::optional<checkpoint::PartMap> map) {
  if (placement != nullptr) dispatch_keys::register_fallback_once<&layout_fallback>(kLayoutKey);
  SplitTensors& r = split_tensors();
  std::lock_guard<std::mutex> lock(r.mu);
  forget_expired_locked();
  const bool keyed = placement != nullptr;
  r.entries.insert_or_assign(param.unsafeGetTensorImpl(),
                             Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), &group, copies,
                                   std::move(placement),
                                   map ? std::make_shared<const checkpoint::PartMap>(std::move(*map)) : nullptr,
                                   false});
  if (keyed) dispatch_keys::add(param.unsafeGetTensorImpl(), kLayoutKey);
}

checkpoint::PartMap map_of_cut(at::IntArrayRef whole_shape, const Cut& cut) {
  c10::impl::ExcludeDispatchKeyGuard exclude(kLayoutKey);
  at::NoGradGuard no_grad;
  const at::Tensor index = at::arange(c10::multiply_integers(whole_shape), at::kLong).view(whole_shape);
  const at::Tensor part = cut(index).contiguous();
  STRATA_CHECK(part.scalar_type() == at::kLong, "a layer's cut of a parameter changed its dtype; a cut only selects");
  return checkpoint::PartMap::from_indices(whole_shape.vec(), part.data_ptr<int64_t>(), part.numel());
}

at::Tensor cut_part(const at::Tensor& whole, const Cut& cut, checkpoint::PartMap* map) {
  *map = map_of_cut(whole.sizes(), cut);
  at::NoGradGuard no_grad;
  return cut(whole).clone();
}

std::optional<checkpoint::PartMap> part_map_of(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(split_tensors().mu);
  const Entry* e = find_locked(param);
  if (e == nullptr || e->map == nullptr) return std::nullopt;
  return *e->map;
}

void restore_placement_key(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(split_tensors().mu);
  const Entry* e = find_locked(t);
  if (e != nullptr && e->placement != nullptr) dispatch_keys::add(t.unsafeGetTensorImpl(), kLayoutKey);
}

}  // namespace tensor_layout

void mark_split(const torch::Tensor& param, Communicator& group, int copies) {
  tensor_layout::place(param, group, copies, nullptr, std::nullopt);
}

Communicator* tensor_group_of(const torch::Tensor& param) {
  std::lock_guard<std::mutex> lock(tensor_layout::split_tensors().mu);
  const tensor_layout::Entry* e = tensor_layout::find_locked(param);
  return e == nullptr ? nullptr : e->group;
}

int tensor_copies_of(const torch::Tensor& param) {
  std::lock_guard<std::mutex> lock(tensor_layout::split_tensors().mu);
  const tensor_layout::Entry* e = tensor_layout::find_locked(param);
  return e == nullptr ? 0 : e->copies;
}

}  // namespace strata::parallel
