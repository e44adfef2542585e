#pragma once
// The dispatch key DeferredInit, which strata uses for two things on one
// boxed fallback (init/lazy_init.cpp): lazy construction (Note [Replaying
// initialisers]) and collecting the storages a block's operators produce for
// activation offload (Note [Offloading a block's activations] in
// activations/offload.cpp). Private to strata_parallel.

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKey.h>

namespace strata::parallel::deferred_key {

constexpr c10::DispatchKey kKey = c10::DispatchKey::DeferredInit;

/// Calls fn on each tensor an operator argument or result holds (a tensor,
/// a tensor list, or a list with tensors in it).
template <typename Fn>
void for_each_tensor(const c10::IValue& v, Fn fn) {
  if (v.isTensor()) {
    fn(v.toTensor());
  } else if (v.isList()) {  // tensor lists too: they are lists of IValues, no proxies or copies
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) fn(e.toTensor());
    }
  }
}

/// Registers the key's fallback, once per process.
void register_fallback();

// Activation collection (activations/offload.cpp), called by the fallback
// around each operator while a collector is active on the thread.
bool collecting();
/// Before the operator runs: the storages of its arguments. Every call is
/// paired with a saw_results (or saw_failure) call.
void saw_arguments(const torch::jit::Stack& stack, size_t arguments);
/// After it ran: the storages of its results (the stack's last `results`).
void saw_results(const torch::jit::Stack& stack, size_t results);
/// The operator threw.
void saw_failure();

}  // namespace strata::parallel::deferred_key
