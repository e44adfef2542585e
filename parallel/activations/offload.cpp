#include "strata/parallel/activation_offload.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <unordered_set>

#include "../dispatch/deferred_key.h"
#include "strata/core/error.h"
#include "strata/core/log.h"
#include "strata/parallel/activation_checkpoint.h"

namespace strata::parallel {

// Note [Offloading a block's activations]
// LibTorch C++ has no saved-tensor hooks to intercept what autograd keeps,
// so the block's forward runs with the dispatch key DeferredInit included on
// the thread (dispatch/deferred_key.h): every operator, and every operator those
// call, passes the key's fallback, which notes the storages of its arguments
// and of its results. A storage first seen as a result was made inside the
// block; one first seen as an argument (an input, a parameter, a view of
// either) was not and is never touched. When the forward returns, the made
// storages still alive, other than those of the block's outputs, are the ones
// something kept: the autograd graph's saved activations. Each is copied to
// host memory and its storage's data pointer swapped to the copy (the
// emulated device: plain host memory outside LibTorch's allocator) or to
// none (CUDA: a pinned host copy kept aside), which releases its device
// memory. The autograd tensors keep their storages, so nothing in the graph
// changes.
//
// A pre-hook on each output's grad_fn brings them back (device memory from
// the allocator, the copy, the pointer swapped back) before the block's
// first backward operator, then starts the previous offloaded block's on a
// thread of its own: in forward order, the next block backward reaches. If
// the graph is freed without a backward, the storages die with it and their
// host copies with them.

namespace {

std::atomic<uint64_t> g_offloaded{0}, g_restored{0}, g_prefetched{0}, g_blocks{0};

// Storages are told apart by address; a weak reference to each one seen
// keeps its StorageImpl object (not its memory) from being freed, so no later
// storage of the block reuses the address.
//
// What comes from outside the block (inputs, parameters, views of them)
// reaches it as an argument of an operator the block's code calls itself
// (depth 0); operators those call (depth > 0) see only what their caller
// passed or made, so an argument there, like the output addmm makes and then
// copies the bias into, is not taken for something from outside.
struct Collector {
  std::unordered_set<const c10::StorageImpl*> arguments, results;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> seen, made;
  int depth = 0;
};

c10::weak_intrusive_ptr<c10::StorageImpl> weak_of(c10::StorageImpl* s) {
  return c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s));
}
thread_local Collector* t_collector = nullptr;

template <typename Fn>
void for_each_storage(const c10::IValue& v, Fn fn) {
  deferred_key::for_each_tensor(v, [&](const at::Tensor& t) {
    if (t.defined() && t.has_storage()) fn(t.storage().unsafeGetStorageImpl());
  });
}

// One offloaded storage.
struct Entry {
  explicit Entry(c10::weak_intrusive_ptr<c10::StorageImpl> s) : storage(std::move(s)) {}
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  c10::Device device{c10::kCPU};
  size_t bytes = 0;
  at::Tensor host;  // CUDA: the pinned copy while offloaded
};

void free_host(void* p) { std::free(p); }

// Copies the storage to host memory and releases its device memory.
bool offload(const c10::intrusive_ptr<c10::StorageImpl>& s, Entry& e) {
  e.device = s->device();
  e.bytes = s->nbytes();
  if (e.device.is_cpu()) {
    void* copy = std::malloc(e.bytes);
    if (copy == nullptr) return false;  // no host memory: it stays where it is
    std::memcpy(copy, s->data_ptr().get(), e.bytes);
    s->set_data_ptr_noswap(c10::DataPtr(copy, copy, &free_host, c10::Device(c10::kCPU)));
  } else {
    const at::Tensor dev = at::from_blob(s->data_ptr().get(), {static_cast<int64_t>(e.bytes)},
                                         at::TensorOptions().dtype(at::kByte).device(e.device));
    e.host = at::empty({static_cast<int64_t>(e.bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    e.host.copy_(dev, /*non_blocking=*/true);  // on the current stream, before the memory is reused
    s->set_data_ptr_noswap(c10::DataPtr(nullptr, e.device));
  }
  return true;
}

uint64_t restore(Entry& e) {
  const c10::intrusive_ptr<c10::StorageImpl> s = e.storage.lock();
  if (!s) return 0;  // the graph let it go
  c10::DataPtr fresh = c10::GetAllocator(e.device.type())->allocate(e.bytes);
  if (e.device.is_cpu()) {
    std::memcpy(fresh.get(), s->data_ptr().get(), e.bytes);
  } else {
    at::from_blob(fresh.get(), {static_cast<int64_t>(e.bytes)}, at::TensorOptions().dtype(at::kByte).device(e.device))
        .copy_(e.host, /*non_blocking=*/true);
  }
  s->set_data_ptr_noswap(std::move(fresh));  // the host copy goes (CPU)
  e.host = at::Tensor();
  return e.bytes;
}

// A block's offloaded activations, owned by the pre-hooks on its outputs'
// grad_fns (so by the graph).
struct Offloaded {
  std::vector<Entry> entries;
  std::weak_ptr<Offloaded> previous;  // the block offloaded before this one
  std::mutex mu;
  bool back = false;
  std::shared_future<void> in_flight;

  void restore_all(bool prefetch) {
    uint64_t bytes = 0;
    for (Entry& e : entries) bytes += restore(e);
    g_restored += bytes;
    if (prefetch) g_prefetched += bytes;
  }
  // Before the block's backward: back on the device, waiting for a prefetch in flight.
  void bring_back() {
    std::shared_future<void> wait;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (back) return;
      back = true;
      if (!in_flight.valid()) {
        restore_all(false);
        return;
      }
      wait = in_flight;
    }
    wait.get();  // rethrows what the prefetch threw
  }
  void prefetch() {
    std::lock_guard<std::mutex> lock(mu);
    if (back || in_flight.valid()) return;
    // `this`, not a shared_ptr: the task's state lives in `in_flight`, so a
    // strong reference there would keep this record alive forever. The
    // destructor waits for the task instead.
    in_flight = std::async(std::launch::async, [this] { restore_all(true); }).share();
  }
  ~Offloaded() {
    if (in_flight.valid()) in_flight.wait();
  }
};
thread_local std::weak_ptr<Offloaded> t_last;

struct BringBack final : torch::autograd::FunctionPreHook {
  explicit BringBack(std::shared_ptr<Offloaded> o) : offloaded(std::move(o)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    offloaded->bring_back();
    if (std::shared_ptr<Offloaded> before = offloaded->previous.lock()) before->prefetch();
    return grads;
  }
  std::shared_ptr<Offloaded> offloaded;
};

}  // namespace

bool deferred_key::collecting() { return t_collector != nullptr; }

void deferred_key::saw_arguments(const torch::jit::Stack& stack, size_t arguments) {
  Collector& c = *t_collector;
  if (c.depth++ > 0) return;
  for (size_t k = stack.size() - arguments; k < stack.size(); ++k) {
    for_each_storage(stack[k], [&](c10::StorageImpl* s) {
      if (!c.results.count(s) && c.arguments.insert(s).second) c.seen.push_back(weak_of(s));
    });
  }
}

void deferred_key::saw_results(const torch::jit::Stack& stack, size_t results) {
  Collector& c = *t_collector;
  --c.depth;
  for (size_t k = stack.size() - results; k < stack.size(); ++k) {
    if (!stack[k].isTensor() && !stack[k].isTensorList() && !stack[k].isList()) continue;
    for_each_storage(stack[k], [&](c10::StorageImpl* s) {
      if (c.arguments.count(s) || !c.results.insert(s).second) return;
      c.made.push_back(weak_of(s));
    });
  }
}

void deferred_key::saw_failure() { --t_collector->depth; }

std::vector<torch::Tensor> offload_activations(const OffloadFn& fn, const std::vector<torch::Tensor>& inputs) {
  if (!torch::GradMode::is_enabled() || recomputing()) return fn(inputs);
  deferred_key::register_fallback();
  Collector collector;
  std::vector<torch::Tensor> outputs;
  {
    Collector* outer = t_collector;
    t_collector = &collector;
    c10::impl::IncludeDispatchKeyGuard include(deferred_key::kKey);
    try {
      outputs = fn(inputs);
    } catch (...) {
      t_collector = outer;
      throw;
    }
    t_collector = outer;
  }
  std::vector<std::shared_ptr<torch::autograd::Node>> nodes;
  for (const torch::Tensor& o : outputs) {
    const auto node = o.defined() ? o.grad_fn() : nullptr;
    if (node && std::find(nodes.begin(), nodes.end(), node) == nodes.end()) nodes.push_back(node);
  }
  if (nodes.empty()) return outputs;  // nothing will run backward through the block
  std::unordered_set<const c10::StorageImpl*> keep;  // the outputs and inputs themselves
  for (const auto& list : {std::cref(outputs), std::cref(inputs)}) {
    for (const torch::Tensor& t : list.get()) {
      if (t.defined() && t.has_storage()) keep.insert(t.storage().unsafeGetStorageImpl());
    }
  }
  c10::optional<c10::Device> device;
  for (const torch::Tensor& t : inputs) {
    if (t.defined() && !device) device = t.device();
  }
  auto offloaded = std::make_shared<Offloaded>();
  uint64_t bytes = 0;
  for (const auto& weak : collector.made) {
    const c10::intrusive_ptr<c10::StorageImpl> s = weak.lock();
    if (!s || keep.count(s.get()) || s->nbytes() == 0 || s->data_ptr().get() == nullptr) continue;
    if (device && s->device().type() != device->type()) continue;  // only what is on the device
    Entry e(weak);
    if (!offload(s, e)) break;
    bytes += e.bytes;
    offloaded->entries.push_back(std::move(e));
  }
  if (offloaded->entries.empty()) return outputs;
  g_offloaded += bytes;
  ++g_blocks;
  offloaded->previous = t_last;
  t_last = offloaded;
  for (const auto& node : nodes) node->add_pre_hook(std::make_unique<BringBack>(offloaded));
  return outputs;
}

torch::Tensor offload_activations(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                                  const torch::Tensor& input) {
  return offload_activations([&](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{fn(in[0])}; },
                             {input})[0];
}

ActivationOffloadStats activation_offload_stats() {
  return {g_offloaded.load(), g_restored.load(), g_prefetched.load(), g_blocks.load()};
}

}  // namespace strata::parallel
