#pragma once
// OpHook: sees every ATen operator that touches a managed tensor, in forward
// and in backward, whatever module or custom code calls it. The engine uses it
// to make a parameter's chunk resident before the operator and to release it
// after (tensor states COMPUTE, then HOLD).
//
// Note [Intercepting operators at the dispatcher]
// A boxed fallback is registered (once per process) for the dispatch key
// TESTING_ONLY_GenericMode, which no tensor carries: the fallback runs only on
// threads whose thread-local "included" key set holds it, which OpHook::Scope
// arranges with c10::impl::IncludeDispatchKeyGuard. The autograd engine copies
// that thread-local state to the threads that run backward, so backward
// operators pass through too. The fallback finds managed tensors among the
// operator's arguments (tensors, tensor lists, optional tensors) by their
// storage, tells the observer, then re-enters the dispatcher with the key
// excluded (ExcludeDispatchKeyGuard) and calls the observer again after.
//
// Why this mechanism: it needs nothing from Python (Colossal-AI's
// __torch_function__ hook misses operators called from C++ and from
// autograd, their issues #3569, #4892, #4984), it does not depend on knowing
// module types, and the key, the guards and Library::fallback exist with the
// same meaning in LibTorch 1.13 and 2.x. Its limits: one hook is active per
// process at a time, and code that reads a parameter's memory without an ATen
// operator (data_ptr<T>() in user code) is not seen.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace strata::parallel {

class OpObserver {
 public:
  virtual ~OpObserver() = default;
  /// `ids` are the distinct managed tensors among the operator's arguments.
  virtual void before_op(const c10::OperatorHandle& op, const std::vector<int64_t>& ids) = 0;
  virtual void after_op(const c10::OperatorHandle& op, const std::vector<int64_t>& ids) = 0;
  /// True: before_op/after_op also run for operators without managed
  /// tensors (ids empty), e.g. while the engine records a trace.
  virtual bool observes_all_ops() const { return false; }
};

class OpHook {
 public:
  explicit OpHook(OpObserver& observer);
  ~OpHook();
  OpHook(const OpHook&) = delete;
  OpHook& operator=(const OpHook&) = delete;

  /// Marks every tensor sharing `t`'s storage (views included) as managed tensor `id`.
  void track(const at::Tensor& t, int64_t id);
  void untrack(const at::Tensor& t);
  size_t tracked() const;

  /// While a Scope lives, operators on this thread (and on the autograd
  /// threads it starts) pass through the hook. Scopes do not nest across hooks.
  class Scope {
   public:
    explicit Scope(OpHook& hook);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    c10::impl::IncludeDispatchKeyGuard include_;
    OpHook* previous_;
  };

  /// The managed ids among the boxed arguments on top of `stack`.
  std::vector<int64_t> managed_arguments(const c10::OperatorHandle& op, const std::vector<c10::IValue>& stack) const;
  OpObserver& observer() { return observer_; }

 private:
  OpObserver& observer_;
  mutable std::mutex mu_;
  std::unordered_map<const c10::StorageImpl*, int64_t> ids_;
};

}  // namespace strata::parallel
