#include "strata/parallel/op_hook.h"

#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>

#include "strata/core/error.h"

namespace strata::parallel {

namespace {

constexpr c10::DispatchKey kHookKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

std::atomic<OpHook*> g_active{nullptr};

void add_id(const at::Tensor& t, std::vector<int64_t>& ids,
            const std::unordered_map<const c10::StorageImpl*, int64_t>& map) {
  if (!t.defined() || !t.has_storage()) return;
  const auto it = map.find(t.storage().unsafeGetStorageImpl());
  if (it != map.end() && std::find(ids.begin(), ids.end(), it->second) == ids.end()) ids.push_back(it->second);
}

// See Note [Intercepting operators at the dispatcher].
void hook_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  OpHook* hook = g_active.load(std::memory_order_acquire);
  std::vector<int64_t> ids;
  if (hook != nullptr) ids = hook->managed_arguments(op, *stack);
  const bool observe = hook != nullptr && (!ids.empty() || hook->observer().observes_all_ops());
  if (observe) hook->observer().before_op(op, ids);
  {
    c10::impl::ExcludeDispatchKeyGuard exclude(kHookKey);
    op.callBoxed(stack);
  }
  if (observe) hook->observer().after_op(op, ids);
}

void register_fallback_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: the registration must outlive every static destructor that may run ops.
    auto* lib = new torch::Library(torch::Library::IMPL, "_", kHookKey, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&hook_fallback>());
  });
}

}  // namespace

OpHook::OpHook(OpObserver& observer) : observer_(observer) { register_fallback_once(); }

OpHook::~OpHook() {
  OpHook* self = this;
  g_active.compare_exchange_strong(self, nullptr);
}

void OpHook::track(const at::Tensor& t, int64_t id) {
  STRATA_CHECK(t.defined() && t.has_storage(), "only dense tensors with storage can be managed");
  std::lock_guard<std::mutex> lock(mu_);
  ids_[t.storage().unsafeGetStorageImpl()] = id;
}

void OpHook::untrack(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return;
  std::lock_guard<std::mutex> lock(mu_);
  ids_.erase(t.storage().unsafeGetStorageImpl());
}

size_t OpHook::tracked() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ids_.size();
}

std::vector<int64_t> OpHook::managed_arguments(const c10::OperatorHandle& op,
                                               const std::vector<c10::IValue>& stack) const {
  const size_t n = op.schema().arguments().size();
  std::vector<int64_t> ids;
  std::lock_guard<std::mutex> lock(mu_);
  if (ids_.empty()) return ids;
  for (size_t i = stack.size() - std::min(n, stack.size()); i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      add_id(v.toTensor(), ids, ids_);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) add_id(t, ids, ids_);
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) add_id(e.toTensor(), ids, ids_);
      }
    }
  }
  return ids;
}

OpHook::Scope::Scope(OpHook& hook) : include_(kHookKey), previous_(g_active.load()) {
  STRATA_CHECK(previous_ == nullptr || previous_ == &hook, "another OpHook is active in this process; "
               "one engine at a time can intercept operators");
  g_active.store(&hook);
}

OpHook::Scope::~Scope() { g_active.store(previous_); }

}  // namespace strata::parallel
