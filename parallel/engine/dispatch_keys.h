#pragma once
// Adding a dispatch key to one tensor's own key set (views made after inherit
// it). TensorImpl keeps the set protected; a derived type may name the
// member. Private to strata_parallel: the operator hook and tensor layouts.

#include <c10/core/TensorImpl.h>

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

}  // namespace strata::parallel::dispatch_keys
