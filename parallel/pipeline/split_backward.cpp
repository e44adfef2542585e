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

// Which nodes reach one of `inputs` (the stage inputs' accumulators), by an
// iterative post-order walk from each root: graphs of deep stages are
// thousands of nodes.
std::unordered_map<ag::Node*, bool> chain_of(const ag::edge_list& roots, const std::unordered_set<ag::Node*>& inputs) {
  std::unordered_map<ag::Node*, bool> on_chain;
  for (const ag::Edge& r : roots) {
    if (!on_chain.emplace(r.function.get(), false).second) continue;  // walked from an earlier root
    std::vector<std::pair<ag::Node*, size_t>> stack{{r.function.get(), 0}};
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      if (next < node->num_outputs()) {
        ag::Node* child = node->next_edge(next++).function.get();
        if (child != nullptr && on_chain.emplace(child, false).second) stack.push_back({child, 0});
        continue;
      }
      bool reaches = inputs.count(node) > 0;
      for (const ag::Edge& e : node->next_edges()) {
        if (e.function && on_chain[e.function.get()]) reaches = true;
      }
      on_chain[node] = reaches;
      stack.pop_back();
    }
  }
  return on_chain;
}

}  // namespace

std::vector<torch::Tensor> SplitBackward::input_pass(const std::vector<torch::Tensor>& outputs,
                                                     const std::vector<torch::Tensor>& grads,
                                                     const std::vector<torch::Tensor>& inputs) {
  STRATA_CHECK(!pending_, "internal: an input pass before the previous weight pass");
  STRATA_CHECK(outputs.size() == grads.size(), "internal: ", outputs.size(), " outputs with ", grads.size(),
               " gradients");
  nodes_.clear();
  whole_.clear();
  whole_grads_.clear();
  ag::edge_list roots;
  ag::variable_list root_grads;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const ag::Edge e = ag::impl::gradient_edge(outputs[i]);
    if (!e.is_valid()) continue;  // a part that needs no gradient
    roots.push_back(e);
    root_grads.push_back(grads[i]);
  }
  pending_ = true;
  std::vector<torch::Tensor> result(inputs.size());
  if (roots.empty()) return result;  // nothing of the output needs a gradient
  ag::edge_list input_edges;
  std::vector<size_t> input_of;  // which input each edge is
  std::unordered_set<ag::Node*> input_nodes;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !inputs[i].requires_grad()) continue;
    input_edges.push_back(ag::impl::gradient_edge(inputs[i]));
    input_of.push_back(i);
    input_nodes.insert(input_edges.back().function.get());
  }
  std::unordered_map<ag::Node*, bool> on_chain = chain_of(roots, input_nodes);
  bool chained = false;
  for (const ag::Edge& r : roots) chained = chained || on_chain[r.function.get()];
  if (input_edges.empty() || !chained) {
    // No chain (a first stage, or outputs that do not depend on the inputs).
    whole_ = roots;
    whole_grads_ = root_grads;
    return result;
  }
  // Weight-consuming nodes: on the chain, with an edge off it.
  ag::edge_list wanted = input_edges;
  std::unordered_set<ag::Node*> visited;
  std::vector<std::shared_ptr<ag::Node>> stack;
  for (const ag::Edge& r : roots) {
    if (on_chain[r.function.get()]) stack.push_back(r.function);
  }
  while (!stack.empty()) {
    std::shared_ptr<ag::Node> n = std::move(stack.back());
    stack.pop_back();
    if (!visited.insert(n.get()).second || input_nodes.count(n.get()) > 0) continue;
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
      wanted.emplace_back(n, i);
      w.inputs.emplace_back(n, i);
    }
    nodes_.push_back(std::move(w));
  }
  // Roots off the chain (parts that do not depend on the inputs) are the
  // weight pass's whole backward.
  ag::edge_list chained_roots;
  ag::variable_list chained_grads;
  for (size_t i = 0; i < roots.size(); ++i) {
    if (on_chain[roots[i].function.get()]) {
      chained_roots.push_back(roots[i]);
      chained_grads.push_back(root_grads[i]);
    } else {
      whole_.push_back(roots[i]);
      whole_grads_.push_back(root_grads[i]);
    }
  }
  const ag::variable_list got =
      ag::Engine::get_default_engine().execute(chained_roots, chained_grads, /*keep_graph=*/true,
                                               /*create_graph=*/false, /*accumulate_grad=*/false, wanted);
  for (size_t k = 0; k < input_edges.size(); ++k) result[input_of[k]] = got[k];
  size_t at = input_edges.size();
  for (WeightNode& w : nodes_) {
    for (size_t i = 0; i < w.inputs.size(); ++i) w.grads.push_back(got[at++]);
  }
  return result;
}

void SplitBackward::weight_pass() {
  STRATA_CHECK(pending_, "internal: a weight pass without its input pass");
  pending_ = false;
  auto& engine = ag::Engine::get_default_engine();
  // keep_graph throughout: nodes two passes share run twice; the graph is
  // freed when the stage drops its output.
  if (!whole_.empty()) {
    engine.execute(whole_, whole_grads_, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/true);
    whole_.clear();
    whole_grads_.clear();
  }
  if (nodes_.empty()) return;
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
