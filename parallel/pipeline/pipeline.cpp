// Pipeline parallelism: stages, links and the schedule runner (pipeline.h).
#include "strata/parallel/pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <unordered_map>

#include "split_backward.h"
#include "strata/core/error.h"
#include "strata/parallel/communicator.h"

namespace strata::parallel::pipeline {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// An activation's shape and dtype ahead of it: fixed size.
constexpr int kMaxDims = 14;
struct Header {
  int64_t dtype = 0;
  int64_t ndim = 0;
  int64_t dims[kMaxDims] = {};
};

Header header_of(const torch::Tensor& t, int stage) {
  STRATA_CHECK(t.dim() <= kMaxDims, "stage ", stage, "'s output has ", t.dim(), " dimensions; at most ", kMaxDims,
               " travel between stages");
  Header h;
  h.dtype = static_cast<int64_t>(t.scalar_type());
  h.ndim = t.dim();
  for (int64_t i = 0; i < t.dim(); ++i) h.dims[i] = t.size(i);
  return h;
}

bool same(const Header& a, const Header& b) {
  if (a.dtype != b.dtype || a.ndim != b.ndim) return false;
  for (int64_t i = 0; i < a.ndim; ++i) {
    if (a.dims[i] != b.dims[i]) return false;
  }
  return true;
}

torch::Tensor empty_of(const Header& h) {
  return torch::empty(std::vector<int64_t>(h.dims, h.dims + h.ndim),
                      torch::TensorOptions().dtype(static_cast<torch::ScalarType>(h.dtype)));
}

std::string shape_string(const Header& h) {
  std::string s = "[";
  for (int64_t i = 0; i < h.ndim; ++i) s += fmt::format("{}{}", i ? ", " : "", h.dims[i]);
  return s + "] " + std::string(c10::toString(static_cast<torch::ScalarType>(h.dtype)));
}

// Note [Tuples between stages]
// A stage's output may be one tensor or several: a std::vector<torch::Tensor>,
// or a std::tuple of two or three tensors (hidden state with positions or a
// mask), which the next stage's first layer takes as its argument. Each part
// travels on its own tag with its own header; the value is rebuilt in the
// sender's type. Floating parts get gradients back (zeros where the receiving
// stage did not use them); other parts (ids, positions, boolean masks) carry
// none.
enum class Kind : int64_t { kTensor = 0, kVector = 1, kTuple2 = 2, kTuple3 = 3 };
constexpr int kMaxParts = 8;
struct Manifest {
  int64_t kind = 0;
  int64_t count = 0;
  Header parts[kMaxParts];
};

bool same(const Manifest& a, const Manifest& b) {
  if (a.kind != b.kind || a.count != b.count) return false;
  for (int64_t i = 0; i < a.count; ++i) {
    if (!same(a.parts[i], b.parts[i])) return false;
  }
  return true;
}

std::string shape_string(const Manifest& m) {
  if (m.kind == static_cast<int64_t>(Kind::kTensor)) return shape_string(m.parts[0]);
  std::string s = "(";
  for (int64_t i = 0; i < m.count; ++i) s += (i ? ", " : "") + shape_string(m.parts[i]);
  return s + ")";
}

// A stage's value: its parts, and the type they came in.
struct Value {
  Kind kind = Kind::kTensor;
  std::vector<torch::Tensor> parts;
};

Value value_of(torch::nn::AnyValue v, int stage) {
  if (auto* t = v.try_get<torch::Tensor>()) return {Kind::kTensor, {*t}};
  if (auto* l = v.try_get<std::vector<torch::Tensor>>()) {
    STRATA_CHECK(!l->empty() && l->size() <= static_cast<size_t>(kMaxParts), "stage ", stage, "'s output is a vector "
                 "of ", l->size(), " tensors; between 1 and ", kMaxParts, " travel between stages");
    return {Kind::kVector, *l};
  }
  if (auto* t2 = v.try_get<std::tuple<torch::Tensor, torch::Tensor>>()) {
    return {Kind::kTuple2, {std::get<0>(*t2), std::get<1>(*t2)}};
  }
  if (auto* t3 = v.try_get<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>>()) {
    return {Kind::kTuple3, {std::get<0>(*t3), std::get<1>(*t3), std::get<2>(*t3)}};
  }
  STRATA_FAIL("stage ", stage, "'s output is of a type that cannot pass between stages (", v.type_info().name(),
              "): return a torch::Tensor, a std::vector<torch::Tensor> or a std::tuple of two or three tensors");
}

torch::nn::AnyValue any_of(const Value& v) {
  switch (v.kind) {
    case Kind::kTensor: return torch::nn::AnyValue(v.parts[0]);
    case Kind::kVector: return torch::nn::AnyValue(v.parts);
    case Kind::kTuple2: return torch::nn::AnyValue(std::make_tuple(v.parts[0], v.parts[1]));
    case Kind::kTuple3: return torch::nn::AnyValue(std::make_tuple(v.parts[0], v.parts[1], v.parts[2]));
  }
  return torch::nn::AnyValue(v.parts[0]);
}

// Runs a stage's layers in order (Sequential::forward, for any value between them).
torch::nn::AnyValue run_layers(torch::nn::Sequential& seq, torch::nn::AnyValue in) {
  for (auto& layer : *seq) in = layer.any_forward(std::move(in));
  return in;
}

// Tags: three per (stage that sent it, microbatch, part): an activation's
// manifest (part 0), the activation, and the gradient going back.
enum class Item { kHeader = 0, kActivation = 1, kGradient = 2 };
uint32_t tag_of(int stage, int mb, int m, Item item, int part = 0) {
  const int64_t base = (static_cast<int64_t>(stage) * m + mb) * 3 + static_cast<int>(item);
  return static_cast<uint32_t>((base * kMaxParts + part) & 0x7fffffff);
}

// This rank's stages as one module to attach.
struct StagesModule : torch::nn::Module {};

}  // namespace

std::vector<double> parameter_costs(torch::nn::Sequential& model) {
  std::vector<double> costs;
  for (const auto& layer : model->children()) {
    double n = 0;
    for (const auto& p : layer->parameters()) n += static_cast<double>(p.numel());
    costs.push_back(n);
  }
  return costs;
}

struct Pipeline::Impl {
  // One direction of one link (Note [Pipeline links]).
  struct Channel {
    std::unique_ptr<Communicator> comm;
    int peer = 0;  // the other end, in comm's numbering
  };
  // A microbatch's state on one of this rank's stages, from forward to its last backward pass.
  struct Pass {
    Value input;   // the received activation (floating parts leaves needing grad) or the microbatch itself
    Value output;  // the stage's output (kept for backward), or the weighted, scaled loss
    std::optional<SplitBackward> split;
  };
  struct Pending {  // a receive posted ahead: one buffer per part (per floating part for gradients)
    int stage, mb;
    Kind kind = Kind::kTensor;
    std::vector<torch::Tensor> buffers;
    std::vector<WorkHandle> works;
  };

  std::shared_ptr<Communicator> group;
  PipelineOptions options;
  int p = 1, r = 0, v = 1, S = 1, m = 1;
  std::vector<int> bounds;
  // Note [Parameters across stages]: every parameter of the model, named
  // "<layer>.<name> (stage <s>)" in stage order (the same on every rank), and
  // the other ranks' stages' ones by their index there: none may get a gradient here.
  std::vector<std::string> names;
  std::vector<std::pair<size_t, torch::Tensor>> foreign;
  // A tied parameter's later names ("<layer>.<name>") -> its first stage and first name.
  std::map<std::string, std::pair<int, std::string>> tied_names;
  std::shared_ptr<StagesModule> holder = std::make_shared<StagesModule>();
  std::map<int, torch::nn::Sequential> stage_modules;  // by virtual stage
  std::vector<Action> actions;
  size_t last_grad_action = 0;  // where the final backward begins
  std::unique_ptr<Engine> engine;

  // Links: `out` carries this rank's outputs to rank r+1 (and their gradients
  // back), `in` the inputs from rank r-1.
  Channel out_act, out_grad, in_act, in_grad;

  // Note [Pipeline links]: the shapes that went ahead for this batch
  // signature; a header travels for exactly the items missing here.
  std::vector<double> signature;
  std::map<std::pair<int, int>, Manifest> act_shapes;    // (stage the activation enters, mb): received
  std::map<std::pair<int, int>, Manifest> sent_shapes;   // (stage that produced it, mb): sent
  std::vector<std::pair<WorkHandle, torch::Tensor>> sends;
  std::deque<std::pair<int, int>> act_order, grad_order;  // receives still to come this step, in order
  std::optional<Pending> act_ahead, grad_ahead;
  std::map<std::pair<int, int>, Pass> passes;
  int64_t bytes = 0;
  double waited = 0.0;  // seconds in receives this step
  Timing timing;

  Impl(std::shared_ptr<Communicator> g, PipelineOptions o) : group(std::move(g)), options(o) {
    STRATA_CHECK(group != nullptr, "a pipeline needs its group's communicator");
    p = group->world_size();
    r = group->rank();
    v = options.virtual_stages;
    m = options.microbatches;
    check_schedule(options.schedule, p, v, m);
    S = p * v;
  }

  void add_stage(int s, torch::nn::Sequential seq) {
    STRATA_CHECK(seq->size() > 0, "stage ", s, " is empty: every stage needs at least one layer");
    holder->register_module("stage" + std::to_string(s), seq);
    stage_modules.emplace(s, std::move(seq));
  }

  void plan() {
    std::vector<std::vector<Action>> all;
    for (int q = 0; q < p; ++q) all.push_back(schedule_actions(options.schedule, q, p, v, m));
    const SimulatedStep sim = simulate(all, p, v, ActionCosts{});
    STRATA_CHECK(sim.completes, "internal: the ", schedule_name(options.schedule), " schedule for ", p,
                 " ranks and ", m, " microbatches would hang: ", sim.stuck);
    actions = all[r];
    for (size_t i = 0; i < actions.size(); ++i) {
      if (actions[i].kind != ActionKind::kForward && actions[i].kind != ActionKind::kBackwardInput) last_grad_action = i;
    }
    connect();
  }

  // Every link's two channels, split in link order so no rank waits on one that waits on it.
  void connect() {
    const bool wrap = v > 1;
    const int links = wrap ? p : p - 1;
    for (int l = 0; l < links && p > 1; ++l) {
      const int a = l, b = (l + 1) % p;
      if (r != a && r != b) continue;
      auto act = group->split({a, b}, fmt::format("strata-pp-act-{}-{}", a, b));
      auto grad = group->split({a, b}, fmt::format("strata-pp-grad-{}-{}", a, b));
      if (r == a) {
        out_act = {std::move(act), 1};
        out_grad = {std::move(grad), 1};
      } else {
        in_act = {std::move(act), 0};
        in_grad = {std::move(grad), 0};
      }
    }
  }

  bool first_stage(int s) const { return s == 0; }
  bool last_stage(int s) const { return s == S - 1; }

  // --- sends and receives --------------------------------------------------

  void send(Channel& c, const torch::Tensor& t, uint32_t tag) {
    torch::Tensor owned = t.contiguous();
    const size_t n = static_cast<size_t>(owned.numel()) * owned.element_size();
    sends.emplace_back(c.comm->send(owned.data_ptr(), n, c.peer, tag), owned);
    bytes += static_cast<int64_t>(n);
  }

  // Note [Tuples between stages].
  void send_activation(int stage, int mb, const Value& y) {
    bool floating = false;
    for (const torch::Tensor& t : y.parts) {
      STRATA_CHECK(t.defined(), "stage ", stage, "'s output has an undefined tensor");
      floating = floating || t.is_floating_point();
    }
    STRATA_CHECK(floating, "stage ", stage, "'s output is ",
                 y.kind == Kind::kTensor ? std::string(c10::toString(y.parts[0].scalar_type())) : "tensors none of which are floating",
                 ": what passes between stages must hold a floating tensor, to carry gradients back");
    Manifest h;
    h.kind = static_cast<int64_t>(y.kind);
    h.count = static_cast<int64_t>(y.parts.size());
    for (size_t i = 0; i < y.parts.size(); ++i) h.parts[i] = header_of(y.parts[i], stage);
    auto known = sent_shapes.find({stage, mb});
    if (known != sent_shapes.end()) {
      STRATA_CHECK(same(known->second, h), "stage ", stage, "'s output for microbatch ", mb, " is ",
                   shape_string(h), " where the same batch shape gave ", shape_string(known->second),
                   " before: a stage's output shape must follow from the batch's");
    } else {
      auto hb = torch::from_blob(&h, {static_cast<int64_t>(sizeof(Manifest))}, torch::kUInt8).clone();
      send(out_act, hb, tag_of(stage, mb, m, Item::kHeader));
      sent_shapes[{stage, mb}] = h;
    }
    for (size_t i = 0; i < y.parts.size(); ++i) {
      send(out_act, y.parts[i].detach(), tag_of(stage, mb, m, Item::kActivation, static_cast<int>(i)));
    }
  }

  // Posts the next receive on a channel when its shape is known.
  void post_ahead(bool grad) {
    std::optional<Pending>& ahead = grad ? grad_ahead : act_ahead;
    std::deque<std::pair<int, int>>& order = grad ? grad_order : act_order;
    if (ahead || order.empty()) return;
    const auto [stage, mb] = order.front();
    Manifest h;
    if (grad) {
      auto it = sent_shapes.find({stage - 1, mb});  // the activation this rank sent
      if (it == sent_shapes.end()) return;
      h = it->second;
    } else {
      auto it = act_shapes.find({stage, mb});
      if (it == act_shapes.end()) return;  // its header has not come yet
      h = it->second;
    }
    Channel& c = grad ? out_grad : in_act;
    Pending pend{stage, mb, static_cast<Kind>(h.kind), {}, {}};
    for (int i = 0; i < h.count; ++i) {
      const torch::Tensor buffer = empty_of(h.parts[i]);
      if (grad && !buffer.is_floating_point()) continue;  // no gradient for ids, positions, masks
      pend.buffers.push_back(buffer);
      pend.works.push_back(c.comm->recv(buffer.data_ptr(), buffer.nbytes(), c.peer,
                                        grad ? tag_of(stage, mb, m, Item::kGradient, i)
                                             : tag_of(stage - 1, mb, m, Item::kActivation, i)));
    }
    order.pop_front();
    ahead = std::move(pend);
  }

  // The activation entering `stage` (all its parts), or the gradients of
  // the floating parts of the one this rank sent into it.
  Value take(bool grad, int stage, int mb) {
    std::optional<Pending>& ahead = grad ? grad_ahead : act_ahead;
    if (!ahead) {
      if (!grad && !act_shapes.count({stage, mb})) {
        Manifest h;
        const auto t0 = Clock::now();
        in_act.comm->recv(&h, sizeof(Manifest), in_act.peer, tag_of(stage - 1, mb, m, Item::kHeader))->wait();
        waited += seconds_since(t0);
        bool sane = h.kind >= 0 && h.kind <= static_cast<int64_t>(Kind::kTuple3) && h.count >= 1 && h.count <= kMaxParts;
        for (int64_t i = 0; sane && i < h.count; ++i) sane = h.parts[i].ndim >= 0 && h.parts[i].ndim <= kMaxDims;
        STRATA_CHECK(sane, "a corrupt activation header from rank ", (r + p - 1) % p);
        act_shapes[{stage, mb}] = h;
      }
      post_ahead(grad);
    }
    STRATA_CHECK(ahead && ahead->stage == stage && ahead->mb == mb, "internal: pipeline receives out of order at stage ",
                 stage, " microbatch ", mb);
    Pending got = std::move(*ahead);
    ahead.reset();
    const auto t0 = Clock::now();
    try {
      for (WorkHandle& w : got.works) w->wait();
    } catch (const std::exception& e) {
      STRATA_FAIL("pipeline rank ", r, " (stage ", grad ? stage - 1 : stage, ") waiting for the ",
                  grad ? "gradient" : "activation", " of microbatch ", mb, " from pipeline rank ",
                  grad ? (r + 1) % p : (r + p - 1) % p, ": ", e.what());
    }
    waited += seconds_since(t0);
    post_ahead(grad);
    return {got.kind, std::move(got.buffers)};
  }

  // --- the actions ---------------------------------------------------------

  std::vector<torch::Tensor> micro_inputs, micro_targets;
  // Microbatches this step or evaluation runs: m, or, evaluating a batch of
  // fewer than m samples, one per sample (the rest are skipped).
  int live = 1;
  std::vector<double> weights, losses;
  double loss_scale = 1.0;
  const LossFn* loss_fn = nullptr;
  bool training = true;
  bool model_names = false;  // cut from one model: "stage<s>.<i>..." is the model's "<i>..."

  void forward(int s, int mb, std::vector<torch::Tensor>* outputs) {
    Pass pass;
    if (first_stage(s)) {
      torch::Tensor x = micro_inputs[mb];
      // Inputs that need a gradient: the first stage runs an input pass like the others; the gradient is dropped.
      if (training && x.requires_grad()) x = x.detach().requires_grad_(true);
      pass.input = {Kind::kTensor, {x}};
    } else {
      pass.input = take(false, s, mb);
      if (training) {
        for (torch::Tensor& t : pass.input.parts) {
          if (t.is_floating_point()) t.requires_grad_(true);
        }
      }
    }
    Value y = value_of(run_layers(stage_modules.at(s), any_of(pass.input)), s);
    if (last_stage(s)) {
      STRATA_CHECK(y.kind == Kind::kTensor, "the last stage's output is ", y.parts.size(), " tensors; it must be one "
                   "tensor, the loss function's and evaluation's");
      if (!training) {
        outputs->push_back(y.parts[0]);
        return;
      }
      torch::Tensor loss = (*loss_fn)(y.parts[0], micro_targets[mb]);
      STRATA_CHECK(loss.defined() && loss.numel() == 1, "the pipeline's loss function must return one number");
      losses[mb] = loss.item<double>() * weights[mb];
      pass.output = {Kind::kTensor, {loss.to(torch::kFloat32) * (weights[mb] * loss_scale)}};
    } else {
      send_activation(s, mb, y);
      pass.output = std::move(y);
    }
    if (training) passes[{s, mb}] = std::move(pass);
  }

  // The gradient of each floating part of the stage's input, zeros where
  // the output did not depend on it.
  void send_input_grads(int s, int mb, const Pass& pass, const std::vector<torch::Tensor>& grads) {
    if (first_stage(s)) return;
    for (size_t i = 0; i < pass.input.parts.size(); ++i) {
      const torch::Tensor& x = pass.input.parts[i];
      if (!x.is_floating_point()) continue;
      torch::Tensor g = i < grads.size() ? grads[i] : torch::Tensor();
      if (!g.defined()) g = torch::zeros_like(x);
      send(in_grad, g.detach(), tag_of(s, mb, m, Item::kGradient, static_cast<int>(i)));
    }
  }

  void backward(const Action& a) {
    const int s = a.stage, mb = a.microbatch;
    auto it = passes.find({s, mb});
    STRATA_CHECK(it != passes.end(), "internal: backward of stage ", s, " microbatch ", mb, " before its forward");
    Pass& pass = it->second;
    if (a.kind == ActionKind::kBackwardWeight) {
      pass.split->weight_pass();
      passes.erase(it);
      return;
    }
    // The outputs that carry gradients back, with theirs: the loss, or the
    // floating parts of the activation (received in that order).
    std::vector<torch::Tensor> outs, grads;
    if (last_stage(s)) {
      outs = pass.output.parts;
      grads = {torch::ones_like(pass.output.parts[0])};
    } else {
      const Value got = take(true, s + 1, mb);
      size_t k = 0;
      for (const torch::Tensor& y : pass.output.parts) {
        if (!y.is_floating_point()) continue;
        STRATA_CHECK(k < got.parts.size(), "internal: fewer gradients than floating outputs at stage ", s);
        if (y.requires_grad()) {
          outs.push_back(y);
          grads.push_back(got.parts[k]);
        }
        ++k;
      }
    }
    if (a.kind == ActionKind::kBackwardInput) {
      pass.split.emplace();
      send_input_grads(s, mb, pass, pass.split->input_pass(outs, grads, pass.input.parts));
      return;
    }
    if (!outs.empty()) torch::autograd::backward(outs, grads);
    std::vector<torch::Tensor> gx;
    for (const torch::Tensor& x : pass.input.parts) gx.push_back(x.requires_grad() ? x.grad() : torch::Tensor());
    send_input_grads(s, mb, pass, gx);
    passes.erase(it);
  }

  // Agrees on the batch with the other stages (Note [Pipeline links]) and splits it into microbatches.
  void begin_step(const torch::Tensor& inputs, const torch::Tensor& targets) {
    constexpr int kSig = 2 + kMaxDims + 1;
    std::vector<double> mine(kSig, 0.0);
    if (r == 0) {
      STRATA_CHECK(inputs.defined(), "the first stage's rank needs the batch's inputs");
      STRATA_CHECK(inputs.dim() >= 1 && inputs.dim() <= kMaxDims, "the inputs need a batch dimension");
      mine[0] = 1;
      mine[1] = static_cast<double>(inputs.scalar_type());
      mine[2] = static_cast<double>(inputs.dim());
      for (int64_t i = 0; i < inputs.dim(); ++i) mine[3 + i] = static_cast<double>(inputs.size(i));
    }
    if (r == p - 1 && training) {
      STRATA_CHECK(targets.defined() && targets.dim() >= 1, "the last stage's rank needs the batch's targets");
      mine[kSig - 1] = static_cast<double>(targets.size(0));
    }
    std::vector<double> all = p > 1 ? all_gather_values(*group, mine) : mine;
    std::vector<double> sig(all.begin(), all.begin() + kSig);
    const int64_t batch = static_cast<int64_t>(sig[3]);
    if (training) {
      const int64_t target_batch = static_cast<int64_t>(all[(p - 1) * kSig + kSig - 1]);
      STRATA_CHECK(target_batch == batch, "the targets hold ", target_batch, " samples but the inputs ", batch,
                   ": both need the whole batch");
    }
    STRATA_CHECK(batch >= m || !training, "a batch of ", batch, " samples cannot make ", m,
                 " microbatches: use a batch of at least ", m, " or fewer microbatches");
    STRATA_CHECK(batch >= 1, "the inputs hold no sample: ", training ? "a step" : "an evaluation",
                 " needs at least one");
    live = static_cast<int>(std::min<int64_t>(m, batch));
    sig[kSig - 1] = 0;  // the targets' part: checked, not part of the shapes
    if (sig != signature) {
      signature = sig;
      act_shapes.clear();
      sent_shapes.clear();
    }
    // Microbatch k gets batch/m samples, and the first batch%m one more (tensor_split).
    weights.assign(m, 0.0);
    losses.assign(m, 0.0);
    for (int k = 0; k < m; ++k) weights[k] = static_cast<double>(batch / m + (k < batch % m ? 1 : 0)) / batch;
    micro_inputs.clear();
    micro_targets.clear();
    if (r == 0) micro_inputs = torch::tensor_split(inputs, m, 0);
    if (r == p - 1 && training) micro_targets = torch::tensor_split(targets, m, 0);
    // The receives this step, in the order the actions take them.
    act_order.clear();
    grad_order.clear();
    for (const Action& a : actions) {
      if (a.microbatch >= live) continue;
      if (a.kind == ActionKind::kForward && !first_stage(a.stage)) act_order.push_back({a.stage, a.microbatch});
      if (training && (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) && !last_stage(a.stage)) {
        grad_order.push_back({a.stage + 1, a.microbatch});
      }
    }
    bytes = 0;
  }

  void end_step() {
    std::exception_ptr failure;
    for (auto& [work, t] : sends) {
      try {
        work->wait();
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    sends.clear();
    passes.clear();
    act_ahead.reset();
    grad_ahead.reset();
    if (failure) std::rethrow_exception(failure);
  }

  // A step or evaluation that threw: nothing of it stays, and the next one
  // sends every header again (the peers may have seen some and not others).
  void abandon() {
    sends.clear();
    passes.clear();
    act_ahead.reset();
    grad_ahead.reset();
    signature.clear();
    act_shapes.clear();
    sent_shapes.clear();
  }

  // Sends that completed give their buffers back.
  void sweep() {
    size_t keep = 0;
    for (size_t i = 0; i < sends.size(); ++i) {
      if (sends[i].first->done()) {
        sends[i].first->wait();  // rethrows a failed send
      } else {
        sends[keep++] = std::move(sends[i]);
      }
    }
    sends.resize(keep);
  }

  double run_actions(double scale) {
    loss_scale = scale;
    double compute = 0.0;
    waited = 0.0;
    for (size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      if (i == last_grad_action) engine->final_backward();
      const auto t0 = Clock::now();
      if (a.kind == ActionKind::kForward) {
        forward(a.stage, a.microbatch, nullptr);
      } else {
        backward(a);
      }
      compute += seconds_since(t0);
      sweep();
    }
    timing.compute = compute - waited;
    double loss = 0.0;
    for (double l : losses) loss += l;
    return loss;
  }
};

namespace {
// A stage's module name of a parameter ("stage<s>.<layer>.<name>") as the model's own ("<layer>.<name>").
std::string model_name(const std::string& name) {
  const size_t dot = name.find('.');
  return name.rfind("stage", 0) == 0 && dot != std::string::npos ? name.substr(dot + 1) : name;
}
}  // namespace

Pipeline::Pipeline(torch::nn::Sequential model, std::shared_ptr<Communicator> group, PipelineOptions options,
                   std::vector<int> boundaries)
    : impl_(std::make_unique<Impl>(std::move(group), options)) {
  Impl& d = *impl_;
  d.model_names = true;
  const int layers = static_cast<int>(model->size());
  if (boundaries.empty()) {
    boundaries = partition_balanced(parameter_costs(model), d.S);
  }
  STRATA_CHECK(static_cast<int>(boundaries.size()) == d.S + 1, "the partition gives ", boundaries.size(),
               " boundaries; ", d.S, " stages need ", d.S + 1, " (0, .., ", layers, ")");
  STRATA_CHECK(boundaries.front() == 0 && boundaries.back() == layers, "the partition must cover the model's ", layers,
               " layers: it runs from ", boundaries.front(), " to ", boundaries.back());
  for (int s = 0; s < d.S; ++s) {
    STRATA_CHECK(boundaries[s] < boundaries[s + 1], "stage ", s, " of the partition is empty (layers ", boundaries[s],
                 " to ", boundaries[s + 1], "): every stage needs at least one layer");
  }
  d.bounds = boundaries;
  // Note [Parameters across stages]
  // Each stage's engine trains the parameters of its own layers. A parameter
  // the layers of several stages register (an output projection tied to the
  // token embedding, registered in both) is tied: each of those stages holds
  // a copy under the name of its first layer, which every copy's engine
  // finds on the other stages (Note [Tied parameters across stages] in
  // parallel/engine/tied_params.h), sums the copies' gradients with them after backward, and
  // updates alike, as Megatron's embedding group does. A parameter a layer
  // only uses by reference from another stage (not registered in it) would
  // train as a copy nobody updates: wrong results without an error. It
  // shows as a gradient on a rank that does not own the parameter, found
  // after the step's passes; the ranks then tell each other (in the gather
  // that brings the last stage's loss to every rank), and every rank refuses
  // the step before its optimizer runs.
  struct Use {
    std::string first;        // "<layer>.<name>" where the model first registers it
    std::vector<int> stages;  // the stages whose layers register it, in order
    torch::Tensor tensor;
  };
  std::vector<Use> uses;
  std::unordered_map<const c10::TensorImpl*, size_t> use_of;
  std::map<std::string, std::pair<int, std::string>> tied_names;  // a later name of a tied parameter -> its first
  for (int s = 0; s < d.S; ++s) {
    for (int i = boundaries[s]; i < boundaries[s + 1]; ++i) {
      for (const auto& item : (model->begin() + i)->ptr()->named_parameters()) {
        const std::string name = fmt::format("{}.{}", i, item.key());
        const auto [it, fresh] = use_of.emplace(item.value().unsafeGetTensorImpl(), uses.size());
        if (fresh) uses.push_back({name, {}, item.value()});
        Use& u = uses[it->second];
        if (!fresh && name != u.first) tied_names.emplace(name, std::make_pair(u.stages.front(), u.first));
        if (u.stages.empty() || u.stages.back() != s) u.stages.push_back(s);
      }
    }
  }
  std::vector<bool> mine(d.S, false);
  for (int c = 0; c < d.v; ++c) mine[c * d.p + d.r] = true;
  for (const Use& u : uses) {
    d.names.push_back(fmt::format("{} (stage {})", u.first, u.stages.front()));
    const bool held = std::any_of(u.stages.begin(), u.stages.end(), [&](int s) { return mine[s]; });
    if (!held && u.tensor.requires_grad()) {
      torch::Tensor t = u.tensor;
      t.mutable_grad() = torch::Tensor();
      d.foreign.emplace_back(d.names.size() - 1, t);
    }
  }
  d.tied_names = std::move(tied_names);
  for (int c = 0; c < d.v; ++c) {
    const int s = c * d.p + d.r;
    torch::nn::Sequential seq;
    for (int i = boundaries[s]; i < boundaries[s + 1]; ++i) seq->push_back(std::to_string(i), *(model->begin() + i));
    d.add_stage(s, seq);
  }
  d.plan();
}

Pipeline::Pipeline(std::vector<torch::nn::Sequential> stages, std::shared_ptr<Communicator> group,
                   PipelineOptions options)
    : impl_(std::make_unique<Impl>(std::move(group), options)) {
  Impl& d = *impl_;
  STRATA_CHECK(static_cast<int>(stages.size()) == d.v, "a manual split gives each rank its ", d.v,
               " stage module(s); rank ", d.r, " gave ", stages.size());
  for (int c = 0; c < d.v; ++c) d.add_stage(c * d.p + d.r, stages[c]);
  d.plan();
}

Pipeline::~Pipeline() = default;

torch::nn::Module& Pipeline::module() { return *impl_->holder; }

Engine& Pipeline::attach(OptimizerConfig optimizer, EngineOptions options, std::shared_ptr<Communicator> data_parallel) {
  Impl& d = *impl_;
  STRATA_CHECK(d.engine == nullptr, "this pipeline is attached already");
  options.pipeline_group = d.group;  // also names each stage's trace (TraceRecorder)
  // Note [Checkpoints across layouts]: parameters by the model's own names,
  // so that another cut into stages finds them. A manual split's stages
  // number their layers from 0 each: their names keep the stage.
  // A tied parameter's later copies go by its first name (Note [Parameters
  // across stages]), in checkpoints and to the optimizer's groups, as in
  // one process, where the module lists it under that name first.
  if (d.model_names) {
    options.checkpoint_name = [tied = d.tied_names](const std::string& name) {
      const std::string own = model_name(name);
      const auto it = tied.find(own);
      return it == tied.end() ? own : it->second.second;
    };
    if (!d.tied_names.empty()) {
      for (ParamGroup& g : optimizer.groups) {
        if (!g.select) continue;
        g.select = [inner = g.select, tied = d.tied_names](const std::string& name, const std::vector<int64_t>& shape) {
          const auto it = tied.find(model_name(name));  // a later copy: its first stage's name
          return inner(it == tied.end() ? name : fmt::format("stage{}.{}", it->second.first, it->second.second), shape);
        };
      }
    }
  }
  d.engine = parallel::attach(*d.holder, std::move(optimizer), std::move(options), std::move(data_parallel));
  return *d.engine;
}

Engine& Pipeline::engine() {
  STRATA_CHECK(impl_->engine != nullptr, "attach the pipeline first (Pipeline::attach)");
  return *impl_->engine;
}

StepResult Pipeline::step(const torch::Tensor& inputs, const torch::Tensor& targets, const LossFn& loss) {
  Impl& d = *impl_;
  Engine& e = engine();
  const auto t0 = Clock::now();
  d.training = true;
  d.loss_fn = &loss;
  d.begin_step(inputs, targets);
  StepResult result;
  try {
    result = e.train_step_passes([&](double scale) {
      const double l = d.run_actions(scale);
      d.end_step();
      // Note [Parameters across stages]: 1 + the index of the first foreign
      // parameter that got a gradient here, 0 for none, gathered with the
      // loss (the last stage's) so every rank refuses the step alike.
      double used = 0;
      for (const auto& [index, p] : d.foreign) {
        if (p.grad().defined()) {
          used = 1.0 + static_cast<double>(index);
          break;
        }
      }
      std::vector<double> all{d.r == d.p - 1 ? l : 0.0, used};
      if (d.p > 1) all = all_gather_values(*d.group, all);
      for (int r = 0; r < d.p; ++r) {
        const double u = all[2 * r + 1];
        STRATA_CHECK(u == 0, "pipeline rank ", r, "'s stages used parameter ", d.names.at(static_cast<size_t>(u) - 1),
                     ", which another stage owns (it got a gradient on that rank): a layer that uses another "
                     "layer's parameter by reference (an output projection tied to the token embedding) must "
                     "register it too (register_module or register_parameter), so that its stage holds a tied "
                     "copy; or keep both layers on one stage (boundaries)");
      }
      return all[2 * (d.p - 1)];  // the last stage's loss
    });
  } catch (...) {
    d.abandon();
    throw;
  }
  // The loss lives on the last stage: every rank reports it (gathered above).
  d.timing.step = seconds_since(t0);
  return result;
}

torch::Tensor Pipeline::forward(const torch::Tensor& inputs) {
  Impl& d = *impl_;
  d.training = false;
  d.begin_step(inputs, torch::Tensor());
  std::vector<torch::Tensor> outputs;
  auto body = [&] {
    torch::NoGradGuard no_grad;
    for (const Action& a : d.actions) {
      if (a.kind == ActionKind::kForward && a.microbatch < d.live) d.forward(a.stage, a.microbatch, &outputs);
    }
    d.end_step();
    return outputs.empty() ? torch::zeros({1}) : torch::cat(outputs, 0);
  };
  torch::Tensor out;
  try {
    out = d.engine ? d.engine->run(body) : body();
  } catch (...) {
    d.abandon();
    throw;
  }
  return d.r == d.p - 1 && !outputs.empty() ? out : torch::Tensor();
}

void Pipeline::save(const std::string& dir) { engine().save(dir); }

void Pipeline::load(const std::string& dir) { engine().load(dir); }

int Pipeline::rank() const { return impl_->r; }
int Pipeline::num_ranks() const { return impl_->p; }
int Pipeline::num_stages() const { return impl_->S; }
std::vector<int> Pipeline::stages() const {
  std::vector<int> s;
  for (const auto& [k, _] : impl_->stage_modules) s.push_back(k);
  return s;
}
const std::vector<int>& Pipeline::boundaries() const { return impl_->bounds; }
int64_t Pipeline::bytes_sent() const { return impl_->bytes; }
const std::vector<Action>& Pipeline::actions() const { return impl_->actions; }
Pipeline::Timing Pipeline::last_timing() const { return impl_->timing; }

}  // namespace strata::parallel::pipeline
