#include "strata/parallel/op_hook.h"


#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>

#include "strata/core/error.h"
#include "strata/core/log.h"
#include "../dispatch/placement.h"
#include "../dispatch/dispatch_keys.h"

namespace strata::parallel {

namespace {

constexpr c10::DispatchKey kHookKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

std::atomic<OpHook*> g_scoped{nullptr};  // the hook whose Scope is active, if any

// Every tracked storage, process-wide: which hook and which id it is.
struct HookedStorages {
  std::mutex mu;
  std::unordered_map<const c10::StorageImpl*, std::pair<OpHook*, int64_t>> entries;
};
HookedStorages& hooked_storages() {
  static auto* r = new HookedStorages;  // never destroyed: static destructors may still run operators
  return *r;
}

struct Found {
  OpHook* hook = nullptr;
  std::vector<int64_t> ids, written;
};

void add_id(const at::Tensor& t, bool writes, Found& f, const c10::OperatorHandle& op) {
  if (!t.defined() || !t.has_storage()) return;
  const auto it = hooked_storages().entries.find(t.storage().unsafeGetStorageImpl());
  if (it == hooked_storages().entries.end()) return;
  const auto [hook, id] = it->second;
  STRATA_CHECK(f.hook == nullptr || f.hook == hook, "operator ", op.schema().name(),
               " takes parameters of two attached engines; use each engine's parameters in its own operators");
  f.hook = hook;
  if (std::find(f.ids.begin(), f.ids.end(), id) == f.ids.end()) f.ids.push_back(id);
  if (writes && std::find(f.written.begin(), f.written.end(), id) == f.written.end()) f.written.push_back(id);
}

Found find_managed(const c10::OperatorHandle& op, const std::vector<c10::IValue>& stack) {
  Found f;
  const auto& args = op.schema().arguments();
  const size_t n = std::min(args.size(), stack.size());
  std::lock_guard<std::mutex> lock(hooked_storages().mu);
  if (hooked_storages().entries.empty()) return f;
  for (size_t k = 0; k < n; ++k) {
    const c10::IValue& v = stack[stack.size() - n + k];
    const bool writes = args[k].alias_info() != nullptr && args[k].alias_info()->isWrite();
    if (v.isTensor()) {
      add_id(v.toTensor(), writes, f, op);
    } else if (v.isList()) {  // tensor lists too: they are lists of IValues, no proxies or copies
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) add_id(e.toTensor(), writes, f, op);
      }
    }
  }
  return f;
}

// See Note [Intercepting operators at the dispatcher].
void hook_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Found found = find_managed(op, *stack);
  OpHook* scoped = c10::impl::tls_is_dispatch_key_included(kHookKey) ? g_scoped.load(std::memory_order_acquire)
                                                                      : nullptr;
  OpHook* hook = found.hook;
  if (hook == nullptr && scoped != nullptr && scoped->observer().observes_all_ops()) hook = scoped;
  if (hook == nullptr) {
    c10::impl::ExcludeDispatchKeyGuard exclude(kHookKey);
    op.callBoxed(stack);
    return;
  }
  OpCall call{op, std::move(found.ids), std::move(found.written), hook == scoped, false};
  hook->observer().before_op(call);
  try {
    c10::impl::ExcludeDispatchKeyGuard exclude(kHookKey);
    op.callBoxed(stack);
  } catch (...) {
    call.failed = true;
    try {
      hook->observer().after_op(call);
    } catch (const std::exception& e) {  // the operator's own error is the one reported
      STRATA_LOG(kWarn, "after the failed operator {}: {}", op.schema().name(), e.what());
    }
    throw;
  }
  hook->observer().after_op(call);
}

}  // namespace

OpHook::OpHook(OpObserver& observer) : observer_(observer) {
  dispatch_keys::register_fallback_once<&hook_fallback>(kHookKey);
}

OpHook::~OpHook() {
  OpHook* self = this;
  g_scoped.compare_exchange_strong(self, nullptr);
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, entry] : tracked_) ids.push_back(id);
  }
  for (int64_t id : ids) untrack(id);
}

void OpHook::mark(const at::Tensor& t) {
  dispatch_keys::add(t.unsafeGetTensorImpl(), kHookKey);
  tensor_layout::restore_placement_key(t);  // set_data took that key too
}

void OpHook::unmark(const at::Tensor& t) { dispatch_keys::remove(t.unsafeGetTensorImpl(), kHookKey); }

OpHook::Bypass OpHook::bypass() { return Bypass(kHookKey); }

void OpHook::track(const at::Tensor& t, int64_t id) {
  STRATA_CHECK(t.defined() && t.has_storage(), "only dense tensors with storage can be managed");
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  {
    std::lock_guard<std::mutex> lock(hooked_storages().mu);
    const auto it = hooked_storages().entries.find(storage);
    STRATA_CHECK(it == hooked_storages().entries.end() || it->second.first == this,
                 "this tensor is already managed by another engine; attach a module to one engine at a time");
    hooked_storages().entries[storage] = {this, id};
  }
  std::lock_guard<std::mutex> lock(mu_);
  tracked_[id] = {c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(t.unsafeGetTensorImpl()), storage};
  mark(t);
}

void OpHook::untrack(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = tracked_.find(id);
  if (it == tracked_.end()) return;
  {
    std::lock_guard<std::mutex> reg(hooked_storages().mu);
    hooked_storages().entries.erase(it->second.second);
  }
  dispatch_keys::remove(it->second.first.get(), kHookKey);
  tracked_.erase(it);
}

size_t OpHook::tracked() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tracked_.size();
}

OpHook::Scope::Scope(OpHook& hook) : include_(kHookKey), previous_(g_scoped.load()) {
  STRATA_CHECK(previous_ == nullptr || previous_ == &hook, "another OpHook is active in this process; "
               "one engine at a time can intercept operators");
  g_scoped.store(&hook);
}

OpHook::Scope::~Scope() { g_scoped.store(previous_); }

}  // namespace strata::parallel
