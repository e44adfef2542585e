#pragma once
// The communicator's collectives on tensors: contiguous host tensors in
// fp32 or fp16 (what Gloo moves), passed to the buffer operations of
// communicator.h. Each returns the operation's Work handle; the tensors must
// stay alive and unchanged until it completes.

#include <torch/torch.h>

#include "strata/parallel/communicator.h"

namespace strata::parallel {

/// In place over ranks.
WorkHandle all_reduce(Communicator& comm, torch::Tensor& t, ReduceOp op = ReduceOp::kSum);
/// `out` gets every rank's `in` stacked along a new first dimension of world_size.
WorkHandle all_gather(Communicator& comm, const torch::Tensor& in, torch::Tensor& out);
/// `in`'s first dimension is world_size; rank r's `out` gets block r of the reduction.
WorkHandle reduce_scatter(Communicator& comm, const torch::Tensor& in, torch::Tensor& out,
                          ReduceOp op = ReduceOp::kSum);
WorkHandle broadcast(Communicator& comm, torch::Tensor& t, int root);
/// Block r (along the first dimension, of world_size) goes to rank r.
WorkHandle all_to_all(Communicator& comm, const torch::Tensor& in, torch::Tensor& out);

}  // namespace strata::parallel
