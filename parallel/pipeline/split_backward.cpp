// The zero-bubble split of a backward pass (Note [Splitting backward]).
#include "split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "strata/core/error.h"

namespace strata::parallel::pipeline {

namespace ag = torch::autograd;

namespace {

// Which nodes reach `input` (the stage input's accumulator), by an iterative
// post-order walk from `root`: graphs of deep stages are thousands of nodes.
std::unordered_map<ag::Node*, bool> chain_of(ag::Node* root, ag::Node* input) {
  std::unordered_map<ag::Node*, bool> on_chain;
  std::vector<std::pair<ag::Node*, size_t>> stack{{root, 0}};
  on_chain[root] = false;
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next < node->num_outputs()) {
      ag::Node* child = node->next_edge(next++).function.get();
      if (child != nullptr && on_chain.emplace(child, false).second) stack.push_back({child, 0});
      continue;
    }
    bool reaches = node == input;
    for (const ag::Edge& e : node->next_edges()) {
      if (e.function && on_chain[e.function.get()]) reaches = true;
    }
    on_chain[node] = reaches;
    stack.pop_back();
  }
  return on_chain;
}

}  // namespace

torch::Tensor SplitBackward::input_pass(const torch::Tensor& output, const torch::Tensor& grad,
                                        const torch::Tensor& input) {
  STRATA_CHECK(!pending_, "internal: an input pass before the previous weight pass");
  nodes_.clear();
  whole_ = ag::Edge();
  const ag::Edge root = ag::impl::gradient_edge(output);
  STRATA_CHECK(root.is_valid(), "the stage's output does not depend on anything that needs a gradient");
  pending_ = true;
  std::unordered_map<ag::Node*, bool> on_chain;
  ag::Edge input_edge;
  if (input.defined() && input.requires_grad()) {
    input_edge = ag::impl::gradient_edge(input);
    on_chain = chain_of(root.function.get(), input_edge.function.get());
  }
  if (!input_edge.is_valid() || !on_chain[root.function.get()]) {
    // No chain (a first stage, or an output that does not depend on the input).
    whole_ = root;
    whole_grad_ = grad;
    return torch::Tensor();
  }
  // Weight-consuming nodes: on the chain, with an edge off it.
  ag::edge_list outputs{input_edge};
  std::unordered_set<ag::Node*> visited;
  std::vector<std::shared_ptr<ag::Node>> stack{root.function};
  while (!stack.empty()) {
    std::shared_ptr<ag::Node> n = std::move(stack.back());
    stack.pop_back();
    if (!visited.insert(n.get()).second || n.get() == input_edge.function.get()) continue;
    WeightNode w;
    for (const ag::Edge& e : n->next_edges()) {
      if (!e.function) continue;
      if (on_chain[e.function.get()]) {
        stack.push_back(e.function);
      } else {
        w.off_chain.push_back(e);
      }
    }
    if (w.off_chain.empty()) continue;
    for (uint32_t i = 0; i < n->num_inputs(); ++i) {
      outputs.emplace_back(n, i);
      w.inputs.emplace_back(n, i);
    }
    nodes_.push_back(std::move(w));
  }
  const ag::variable_list got =
      ag::Engine::get_default_engine().execute({root}, {grad}, /*keep_graph=*/true, /*create_graph=*/false,
                                               /*accumulate_grad=*/false, outputs);
  size_t at = 1;
  for (WeightNode& w : nodes_) {
    for (size_t i = 0; i < w.inputs.size(); ++i) w.grads.push_back(got[at++]);
  }
  return got[0];
}

void SplitBackward::weight_pass() {
  STRATA_CHECK(pending_, "internal: a weight pass without its input pass");
  pending_ = false;
  auto& engine = ag::Engine::get_default_engine();
  // keep_graph throughout: nodes two passes share run twice; the graph is
  // freed when the stage drops its output.
  if (whole_.is_valid()) {
    engine.execute({whole_}, {whole_grad_}, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/true);
    whole_ = ag::Edge();
    whole_grad_ = torch::Tensor();
    return;
  }
  std::vector<WeightNode> nodes = std::move(nodes_);
  nodes_.clear();
  ag::edge_list leaves_from;
  ag::variable_list leaves_grads;
  for (const WeightNode& w : nodes) {
    ag::edge_list edges;
    ag::variable_list grads;
    for (size_t i = 0; i < w.inputs.size(); ++i) {
      if (!w.grads[i].defined()) continue;
      edges.push_back(w.inputs[i]);
      grads.push_back(w.grads[i]);
    }
    if (edges.empty()) continue;  // no gradient reached this node
    const ag::variable_list got = engine.execute(edges, grads, /*keep_graph=*/true, /*create_graph=*/false,
                                                 /*accumulate_grad=*/false, w.off_chain);
    for (size_t i = 0; i < got.size(); ++i) {
      if (!got[i].defined()) continue;
      leaves_from.push_back(w.off_chain[i]);
      leaves_grads.push_back(got[i]);
    }
  }
  if (!leaves_from.empty()) {
    engine.execute(leaves_from, leaves_grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/true);
  }
}

}  // namespace strata::parallel::pipeline
