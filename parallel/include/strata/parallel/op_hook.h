#pragma once
// OpHook: sees every ATen operator that touches a managed tensor, in forward
// and in backward, whatever module or custom code calls it. The engine uses it
// to make a parameter's chunk resident before the operator and to release it
// after (tensor states COMPUTE, then HOLD).
//
// Note [Intercepting operators at the dispatcher]
// A boxed fallback is registered (once per process) for the dispatch key
// TESTING_ONLY_GenericMode. A tracked tensor carries that key in its own
// dispatch key set (views inherit it), so every operator on it, on any
// thread, in or out of a train_step, passes through the fallback; inside a
// Scope the key is also in the thread-local "included" set, so that every
// operator passes (the trace records them all), and the autograd engine
// copies that thread-local state to the threads that run backward. The
// fallback finds managed tensors among the operator's arguments (tensors,
// tensor lists, optional tensors) by their storage, tells the hook's observer
// which (and which the operator writes, from the schema's alias annotations),
// then re-enters the dispatcher with the key excluded
// (ExcludeDispatchKeyGuard), and calls the observer again after, also when
// the operator throws.
//
// Why this mechanism: it needs nothing from Python (Colossal-AI's
// __torch_function__ hook misses operators called from C++ and from
// autograd, their issues #3569, #4892, #4984), it does not depend on knowing
// module types, and the key, the guards and Library::fallback exist with the
// same meaning in LibTorch 1.13 and 2.x. Its limits: one Scope is active per
// process at a time, and code that reads a parameter's memory without an ATen
// operator (data_ptr<T>() in user code, torch::save's pickler) is not seen.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace strata::parallel {

/// One operator passing through the hook.
struct OpCall {
  const c10::OperatorHandle& op;
  std::vector<int64_t> ids;      // the distinct managed tensors among its arguments
  std::vector<int64_t> written;  // those of `ids` it writes (in place or out=), by its schema
  bool in_scope = false;         // runs under this hook's Scope (its thread or the autograd threads it started)
  bool failed = false;           // after_op: the operator threw
};

class OpObserver {
 public:
  virtual ~OpObserver() = default;
  /// Before the operator. Throwing stops it: it does not run, and after_op is not called.
  virtual void before_op(const OpCall& call) = 0;
  /// After the operator, also when it threw (call.failed).
  virtual void after_op(const OpCall& call) = 0;
  /// True: inside a Scope, before_op/after_op also run for operators
  /// without managed tensors (ids empty), e.g. while the engine records a trace.
  virtual bool observes_all_ops() const { return false; }
};

class OpHook {
 public:
  explicit OpHook(OpObserver& observer);
  ~OpHook();
  OpHook(const OpHook&) = delete;
  OpHook& operator=(const OpHook&) = delete;

  /// Marks every tensor sharing `t`'s storage (views included) as managed
  /// tensor `id`, and puts the hook's key on `t`: from now on every operator
  /// on `t` or its views, on any thread, passes through the hook.
  void track(const at::Tensor& t, int64_t id);
  /// Forgets managed tensor `id` and takes the key off the tensor tracked as it.
  void untrack(int64_t id);
  size_t tracked() const;
  /// Puts the key back on `t` (after Tensor::set_data, which replaces a
  /// tensor's key set with its new data's).
  static void mark(const at::Tensor& t);
  static void unmark(const at::Tensor& t);

  /// While a Scope lives, every operator on this thread (and on the autograd
  /// threads it starts) passes through the hook, and calls on tracked tensors
  /// are in_scope. Scopes do not nest across hooks.
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

  OpObserver& observer() { return observer_; }
  /// Code that runs operators on tracked tensors without the hook (the engine's own copies).
  using Bypass = c10::impl::ExcludeDispatchKeyGuard;
  static Bypass bypass();

 private:
  OpObserver& observer_;
  // id -> the tensor tracked as it and the storage it was tracked by; the
  // storages themselves are in a process-wide registry (op_hook.cpp), so
  // the fallback finds the hook a tensor belongs to.
  mutable std::mutex mu_;
  std::unordered_map<int64_t, std::pair<c10::intrusive_ptr<c10::TensorImpl>, const c10::StorageImpl*>> tracked_;
};

}  // namespace strata::parallel
