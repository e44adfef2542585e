#pragma once
// Adding a dispatch key to one tensor's own key set (views made after inherit
// it), and registering a key's fallback. TensorImpl keeps the set protected; a derived type may name the
// member. Private to strata_parallel: the operator hook and tensor layouts.

#include <c10/core/TensorImpl.h>
#include <torch/library.h>

#include <mutex>

namespace strata::parallel::dispatch_keys {

struct KeySetAccess : c10::TensorImpl {
  static c10::DispatchKeySet c10::TensorImpl::*member() { return &KeySetAccess::key_set_; }
};

inline void add(c10::TensorImpl* impl, c10::DispatchKey key) {
  impl->*KeySetAccess::member() = (impl->*KeySetAccess::member()).add(key);
}
inline void remove(c10::TensorImpl* impl, c10::DispatchKey key) {
  impl->*KeySetAccess::member() = (impl->*KeySetAccess::member()).remove(key);
}

/// Registers `Fallback` as the boxed fallback of `key`, once per process (per
/// Fallback). The registration is never destroyed: it must outlive every
/// static destructor that may run operators. `Fallback` is a boxed function,
/// with or without the dispatch key set as its second argument.
template <auto Fallback>
void register_fallback_once(c10::DispatchKey key) {
  static std::once_flag once;
  std::call_once(once, [key] {
    auto* lib = new torch::Library(torch::Library::IMPL, "_", key, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<Fallback>());
  });
}

}  // namespace strata::parallel::dispatch_keys
