#pragma once
// Note [LibTorch 1.13 and 2.x]
// strata builds against Debian 12's LibTorch 1.13, Debian 13's 2.6 and the
// GPU machines' pip 2.11. What differs between them, and how strata meets
// it, is kept here (or, where it lives in one function's logic, named here):
//   - Operator schemas: sizes and some int arguments are `int[]`/`int` in
//     1.13 and `SymInt[]`/`SymInt` in 2.x (aten::layer_norm's
//     normalized_shape, aten::embedding's padding_idx). int_arg reads both.
//   - F::linear is aten::t + aten::addmm/matmul in 1.13 and one aten::linear
//     in 2.x; the tensor-parallel fallback (tensor/placement.cpp) handles both
//     forms, remembering a placed weight's aten::t.
//   - The TCPStore's server defaults to libuv since 2.4, and a LibTorch built
//     without libuv (Debian's) then refuses to start one. start_tcp_store
//     asks for the default and, refused for that reason, starts the classic
//     server; clients speak the same protocol to either.
//   - Dispatch keys: DeferredInit, TESTING_ONLY_GenericWrapper and
//     TESTING_ONLY_GenericMode exist in both, in the same order around
//     Autograd, so the operator hook, tensor layouts and lazy init register
//     the same fallbacks (engine/op_hook.cpp, tensor/placement.cpp,
//     dispatch/deferred_key.h).
// Private to strata_parallel.

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdint>
#include <string>

namespace strata::parallel::torch_compat {

/// An operator's int argument: `int` in 1.13's schemas, `SymInt` in 2.x's.
inline int64_t int_arg(const c10::IValue& v) { return v.isInt() ? v.toInt() : v.toSymInt().expect_int(); }

namespace detail {
template <typename Options>
auto set_libuv(Options& o, bool on, int) -> decltype(o.useLibUV = on, bool()) {
  o.useLibUV = on;
  return true;
}
template <typename Options>
bool set_libuv(Options&, bool, long) {
  return false;  // 1.13 has no libuv server
}
}  // namespace detail

/// A c10d::TCPStore at host:options.port: LibTorch's default server where
/// this build has it, the classic one where it has no libuv.
inline c10::intrusive_ptr<c10d::TCPStore> start_tcp_store(const std::string& host, c10d::TCPStoreOptions options) {
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, options);
  } catch (const std::exception& e) {
    const bool no_libuv = std::string(e.what()).find("libuv") != std::string::npos;
    if (!no_libuv || !detail::set_libuv(options, false, 0)) throw;
    return c10::make_intrusive<c10d::TCPStore>(host, options);
  }
}

}  // namespace strata::parallel::torch_compat
