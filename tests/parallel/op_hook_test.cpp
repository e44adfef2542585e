// The dispatcher hook sees every operator on managed tensors, forward and
// backward, from modules and from custom arithmetic, and changes no result.
#include "strata/parallel/op_hook.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "strata/core/error.h"

namespace strata::parallel {
namespace {

struct Recorder : OpObserver {
  struct Event {
    std::string op;
    std::vector<int64_t> ids;
    bool before;
    bool in_scope;
    std::vector<int64_t> written;
  };
  std::vector<Event> events;
  int depth = 0;
  int max_depth = 0;
  void before_op(const OpCall& c) override {
    events.push_back({c.op.schema().name(), c.ids, true, c.in_scope, c.written});
    max_depth = std::max(max_depth, ++depth);
  }
  void after_op(const OpCall& c) override {
    events.push_back({c.op.schema().name(), c.ids, false, c.in_scope, c.written});
    --depth;
  }
  std::set<int64_t> ids_seen(size_t from = 0) const {
    std::set<int64_t> s;
    for (size_t i = from; i < events.size(); ++i) s.insert(events[i].ids.begin(), events[i].ids.end());
    return s;
  }
  bool saw(const std::string& op, int64_t id, size_t from = 0) const {
    for (size_t i = from; i < events.size(); ++i) {
      if (events[i].op == op && std::count(events[i].ids.begin(), events[i].ids.end(), id)) return true;
    }
    return false;
  }
};

// Linear -> relu -> custom arithmetic with a bare parameter, plus an embedding
// and an unused parameter.
struct Net : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc{nullptr};
  torch::Tensor scale, unused;
  Net() {
    emb = register_module("emb", torch::nn::Embedding(10, 8));
    fc = register_module("fc", torch::nn::Linear(8, 4));
    scale = register_parameter("scale", torch::randn({4}));
    unused = register_parameter("unused", torch::randn({3}));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    torch::Tensor x = torch::relu(fc->forward(emb->forward(tokens)));
    return x * scale + scale.sum();
  }
};

TEST(OpHook, SeesForwardBackwardAndCustomArithmeticWithoutChangingResults) {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  const torch::Tensor tokens = torch::tensor({1, 3, 5, 7}, torch::kLong);

  // Reference without the hook.
  net->zero_grad();
  net->forward(tokens).pow(2).sum().backward();
  std::map<std::string, torch::Tensor> ref;
  for (const auto& p : net->named_parameters()) ref[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : torch::Tensor();

  Recorder rec;
  OpHook hook(rec);
  std::map<std::string, int64_t> id_of;
  int64_t next = 0;
  for (const auto& p : net->named_parameters()) {
    id_of[p.key()] = next;
    hook.track(p.value(), next++);
  }
  EXPECT_EQ(hook.tracked(), 5u);

  net->zero_grad();
  torch::Tensor loss;
  size_t forward_end = 0;
  {
    OpHook::Scope scope(hook);
    loss = net->forward(tokens).pow(2).sum();
    forward_end = rec.events.size();
    loss.backward();
  }
  // Forward: every used parameter, through modules and bare arithmetic.
  const auto fwd = rec.ids_seen();
  for (const char* name : {"emb.weight", "fc.weight", "fc.bias", "scale"}) {
    EXPECT_TRUE(fwd.count(id_of[name])) << name << " was not seen";
  }
  EXPECT_FALSE(fwd.count(id_of["unused"])) << "an unused parameter is not touched";
  EXPECT_TRUE(rec.saw("aten::sum", id_of["scale"])) << "p.sum() in custom code";
  // Backward: the gradient of fc's input needs fc.weight, and of x * scale needs scale.
  bool weight_in_backward = false, scale_in_backward = false;
  for (size_t i = forward_end; i < rec.events.size(); ++i) {
    for (int64_t id : rec.events[i].ids) {
      weight_in_backward |= id == id_of["fc.weight"];
      scale_in_backward |= id == id_of["scale"];
    }
  }
  EXPECT_TRUE(weight_in_backward) << "backward operators pass through the hook";
  EXPECT_TRUE(scale_in_backward);
  // Every before has its after, and nothing nests (each op is redispatched without the hook).
  size_t befores = 0;
  for (const auto& e : rec.events) befores += e.before;
  EXPECT_EQ(befores * 2, rec.events.size());
  EXPECT_EQ(rec.depth, 0);
  EXPECT_EQ(rec.max_depth, 1);
  // Same gradients as without the hook.
  for (const auto& p : net->named_parameters()) {
    if (!ref[p.key()].defined()) {
      EXPECT_FALSE(p.value().grad().defined()) << p.key();
      continue;
    }
    EXPECT_TRUE(torch::equal(p.value().grad(), ref[p.key()])) << p.key();
  }
}

TEST(OpHook, ViewsListsAndWritesAreSeenInAndOutOfScopeOnEveryThread) {
  Recorder rec;
  OpHook hook(rec);
  torch::Tensor w = torch::randn({3, 3});
  hook.track(w, 42);
  torch::Tensor other = torch::randn({3, 3});
  other.mm(other);  // no managed tensor, no scope: not seen
  EXPECT_TRUE(rec.events.empty());
  {
    OpHook::Scope scope(hook);
    at::addmm(other, other, w.t());        // a view of a managed tensor
    at::cat({other, w});                   // a tensor list
    other.mm(other);                       // no managed tensor: no event
    torch::NoGradGuard no_grad;
    w.add_(1.0);                           // in-place
  }
  EXPECT_TRUE(rec.saw("aten::addmm", 42));
  EXPECT_TRUE(rec.saw("aten::cat", 42));
  EXPECT_TRUE(rec.saw("aten::add_", 42));
  for (const auto& e : rec.events) {
    EXPECT_NE(e.op, "aten::mm") << "ops on unmanaged tensors are not reported";
    EXPECT_TRUE(e.in_scope) << e.op;
    EXPECT_EQ(e.written, e.op == "aten::add_" ? std::vector<int64_t>{42} : std::vector<int64_t>{}) << e.op;
  }
  // Outside the scope, on this thread and another, a managed tensor still passes, marked out of scope.
  const size_t seen = rec.events.size();
  {
    torch::NoGradGuard no_grad;
    w.mul_(2.0);
  }
  std::thread([&] { (void)w.sum(); }).join();
  ASSERT_EQ(rec.events.size(), seen + 4);
  EXPECT_EQ(rec.events[seen].op, "aten::mul_");
  EXPECT_FALSE(rec.events[seen].in_scope);
  EXPECT_EQ(rec.events[seen].written, std::vector<int64_t>{42});
  EXPECT_EQ(rec.events[seen + 2].op, "aten::sum");
  EXPECT_TRUE(rec.events[seen + 2].written.empty());
  // Untracked: the key is gone and nothing more is seen.
  hook.untrack(42);
  (void)w.sum();
  EXPECT_EQ(rec.events.size(), seen + 4);
}

TEST(OpHook, AnOperatorThatThrowsIsStillClosed) {
  Recorder rec;
  OpHook hook(rec);
  torch::Tensor w = torch::randn({3, 3});
  hook.track(w, 7);
  EXPECT_ANY_THROW(w.mm(torch::randn({4, 4})));  // a shape error inside the operator
  ASSERT_EQ(rec.events.size(), 2u);
  EXPECT_TRUE(rec.events[0].before);
  EXPECT_FALSE(rec.events[1].before);
  EXPECT_EQ(rec.depth, 0);
}

TEST(OpHook, OneActiveHookPerProcess) {
  Recorder a, b;
  OpHook first(a), second(b);
  OpHook::Scope scope(first);
  EXPECT_THROW(OpHook::Scope{second}, Error);
}

}  // namespace
}  // namespace strata::parallel
