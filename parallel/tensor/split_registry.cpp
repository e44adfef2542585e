// Which parameters tensor-parallel layers split, and over which group
// (tensor_group_of): built without a communicator backend, since the engine
// asks it whatever the build.
#include <mutex>
#include <unordered_map>

#include "strata/parallel/tensor_parallel.h"

namespace strata::parallel {

namespace {
struct SplitRegistry {
  std::mutex mu;
  // By TensorImpl; the weak pointer tells a live parameter from a new tensor at a reused address.
  std::unordered_map<const c10::TensorImpl*, std::pair<c10::weak_intrusive_ptr<c10::TensorImpl>, Communicator*>> split;
};
SplitRegistry& split_registry() {
  static auto* r = new SplitRegistry;
  return *r;
}
}  // namespace

void mark_split(const torch::Tensor& param, Communicator& group) {
  SplitRegistry& r = split_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto it = r.split.begin(); it != r.split.end();) {  // forget parameters that are gone
    it = it->second.first.expired() ? r.split.erase(it) : std::next(it);
  }
  r.split.insert_or_assign(param.unsafeGetTensorImpl(),
                           std::make_pair(c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), &group));
}

Communicator* tensor_group_of(const torch::Tensor& param) {
  SplitRegistry& r = split_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto it = r.split.find(param.unsafeGetTensorImpl());
  if (it == r.split.end() || it->second.first.lock().get() != param.unsafeGetTensorImpl()) return nullptr;
  return it->second.second;
}

}  // namespace strata::parallel
