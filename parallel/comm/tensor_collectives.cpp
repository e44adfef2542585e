#include "strata/parallel/tensor_collectives.h"

#include "strata/core/error.h"

namespace strata::parallel {
namespace {

DType dtype_of(const torch::Tensor& t, const char* what) {
  STRATA_CHECK(t.defined() && t.device().is_cpu() && t.is_contiguous(), what,
               ": the tensor must be a contiguous host tensor");
  if (t.scalar_type() == torch::kFloat32) return DType::kFloat32;
  if (t.scalar_type() == torch::kFloat16) return DType::kFloat16;
  if (t.scalar_type() == torch::kBFloat16) return DType::kBFloat16;
  STRATA_FAIL(what, ": tensors of ", t.scalar_type(), " are not supported; use fp32, fp16 or bf16");
}

void check_blocks(const Communicator& comm, const torch::Tensor& whole, const torch::Tensor& block, const char* what) {
  STRATA_CHECK(whole.dim() >= 1 && whole.size(0) == comm.world_size() &&
                   whole.numel() == block.numel() * comm.world_size() && whole.scalar_type() == block.scalar_type(),
               what, ": the stacked tensor must be [world_size, ...] of the block's dtype and size (world_size ",
               comm.world_size(), ", stacked ", whole.sizes(), ", block ", block.sizes(), ")");
}

}  // namespace

WorkHandle all_reduce(Communicator& comm, torch::Tensor& t, ReduceOp op) {
  return comm.all_reduce(t.data_ptr(), static_cast<size_t>(t.numel()), dtype_of(t, "all_reduce"), op);
}

WorkHandle all_gather(Communicator& comm, const torch::Tensor& in, torch::Tensor& out) {
  const DType d = dtype_of(in, "all_gather");
  dtype_of(out, "all_gather");
  check_blocks(comm, out, in, "all_gather");
  return comm.all_gather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel()), d);
}

WorkHandle reduce_scatter(Communicator& comm, const torch::Tensor& in, torch::Tensor& out, ReduceOp op) {
  const DType d = dtype_of(in, "reduce_scatter");
  dtype_of(out, "reduce_scatter");
  check_blocks(comm, in, out, "reduce_scatter");
  return comm.reduce_scatter(in.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()), d, op);
}

WorkHandle broadcast(Communicator& comm, torch::Tensor& t, int root) {
  return comm.broadcast(t.data_ptr(), static_cast<size_t>(t.numel()), dtype_of(t, "broadcast"), root);
}

WorkHandle all_to_all(Communicator& comm, const torch::Tensor& in, torch::Tensor& out) {
  const DType d = dtype_of(in, "all_to_all");
  dtype_of(out, "all_to_all");
  STRATA_CHECK(in.sizes() == out.sizes() && in.scalar_type() == out.scalar_type() && in.dim() >= 1 &&
                   in.size(0) == comm.world_size(),
               "all_to_all: in and out must both be [world_size, ...] of one dtype");
  return comm.all_to_all(in.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel() / comm.world_size()), d);
}

}  // namespace strata::parallel
