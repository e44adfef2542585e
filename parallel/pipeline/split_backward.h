#pragma once
// The zero-bubble split of one backward pass: input gradients first (the
// pass the previous stage waits for), weight gradients later. Private to
// strata_parallel.
//
// Note [Splitting backward]
// The autograd graph of a stage's forward has an "input chain": the nodes
// from which the stage input's accumulator can be reached. Parameters hang
// off it: a node on the chain (addmm's, layer norm's backward) that also has
// an edge into a part of the graph which never reaches the input consumes a
// weight. The input pass runs the graph from the outputs with only the input
// as target (keep_graph): every node on the chain runs and computes only the
// outputs the input needs (addmm skips its weight product), and the
// gradients flowing into each weight-consuming node are captured on the way.
// The weight pass then runs each such node again from its captured gradients,
// with its own off-chain edges as the only targets (captured, not run): it
// computes just its weight outputs, and never walks the chain, even when a
// weight it uses is also reached through the chain (a tied or reused
// weight). One node at a time, since targets for all at once would mark the
// chain between them as needed and recompute it. Last, one run from all
// those off-chain edges, with their captured gradients, accumulates the
// parameters' gradients (through the engine's gradient sink): nothing
// beneath them reaches the chain. A stage whose input needs no gradient (the
// first) has no chain: its input pass does nothing and its weight pass is
// the whole backward.

#include <torch/torch.h>

#include <vector>

namespace strata::parallel::pipeline {

class SplitBackward {
 public:
  /// The input pass: the gradients of `inputs` (leaves; one undefined or
  /// not requiring grad gets none) from `outputs` with gradients `grads`.
  /// Returns each input's gradient (undefined when it has none) and keeps
  /// the captured gradients for weight_pass(). A stage passing a tuple of
  /// tensors has several of each.
  std::vector<torch::Tensor> input_pass(const std::vector<torch::Tensor>& outputs,
                                        const std::vector<torch::Tensor>& grads,
                                        const std::vector<torch::Tensor>& inputs);
  /// The weight pass: accumulates the parameters' gradients; frees the graph.
  void weight_pass();

 private:
  // A weight-consuming node: the gradients flowing into it, and its edges off the chain.
  struct WeightNode {
    torch::autograd::edge_list inputs;
    torch::autograd::variable_list grads;
    torch::autograd::edge_list off_chain;
  };
  std::vector<WeightNode> nodes_;
  // Without a chain: the whole backward from the outputs.
  torch::autograd::edge_list whole_;
  torch::autograd::variable_list whole_grads_;
  bool pending_ = false;
};

}  // namespace strata::parallel::pipeline
