#pragma once
// The arithmetic of the 2D/2.5D and 3D layers on given weights: each rank's
// part of a whole weight, and the forward of each layer from its parts. The
// layer modules (tensor_parallel_2d.h, tensor_parallel_3d.h) and
// parallelize()'s grid modes (parallelize_grid.cpp, on an unmodified
// module's own parameters) both run these, so the two cannot drift apart.
// Private to strata_parallel.
//
// The *_part functions take a whole parameter and return this rank's part
// (a new tensor); `what` names the parameter in the error when the grid does
// not divide it. A `bias` argument may be undefined (none).

#include <torch/types.h>

#include <string>

#include "strata/parallel/tensor_parallel_2d.h"
#include "strata/parallel/tensor_parallel_3d.h"

namespace strata::parallel::grid_ops {

/// Rows of block `index` of `parts` along dimension 0 of a weight whose rows
/// stack `fused` equal blocks (a fused QKV projection: 3): the block's slice
/// of each fused block, concatenated, so a chunk(fused) of the layer's output
/// gives this rank's features of each.
/// `what` names the rows ("the output features"), `of` the parameter, in the error when they do not divide.
torch::Tensor fused_block_rows(const torch::Tensor& t, int fused, int index, int parts, const std::string& what,
                               const std::string& of);

/// n / parts, or an error naming the layout ("2D", "3D"), what is split
/// ("the batch") and `of` (the layer or parameter, when there is one) when
/// `parts` does not divide n.
int64_t grid_block(int64_t n, int parts, const char* layout, const std::string& what, const std::string& of = "");
/// A parameter replicated over `group` (null: no group), as its forward
/// reads it: the identity forward, its gradient summed over the group in backward.
torch::Tensor shared_over(const torch::Tensor& p, Communicator* group);

// --- 2D and 2.5D (TensorGrid, Note [SUMMA] in layers_2d.cpp) ----------------

/// A Linear's weight [out, in] (`fused` blocks of rows): W[output block col, input block row].
torch::Tensor linear_2d_part(const torch::Tensor& w, const TensorGrid& g, int fused, const std::string& what);
/// Block col of a vector of features (a linear's bias, a norm's weight or bias), `fused` blocks of it.
torch::Tensor features_2d_part(const torch::Tensor& v, const TensorGrid& g, int fused, const std::string& what);
/// An Embedding's table [vocab, dim] split q^2 ways along dim: block col * q + row.
torch::Tensor embedding_2d_part(const torch::Tensor& w, const TensorGrid& g, const std::string& what);
/// An Embedding's table split by vocabulary over the column and by dim over
/// the row: [vocab block row, dim block col]; `vocab_begin` gets its first id.
torch::Tensor vocab_embedding_2d_part(const torch::Tensor& w, const TensorGrid& g, int64_t* vocab_begin,
                                      const std::string& what);

/// x [batch/(q d), ..., in/q] -> [batch/(q d), ..., out/q] with this rank's
/// weight block `w` and bias block.
torch::Tensor linear_2d(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, TensorGrid& g);
/// LayerNorm over the last dimension of `features`, split over the row.
torch::Tensor layer_norm_2d(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
                            int64_t features, double eps, TensorGrid& g);
/// Lookups of `ids` (as given) in an embedding_2d_part: [..., dim/q], feature block col.
torch::Tensor embedding_2d(const torch::Tensor& w, const torch::Tensor& ids, TensorGrid& g);
/// Lookups of this rank's batch block of ids [batch/(q d), ...] in a vocab_embedding_2d_part.
torch::Tensor vocab_embedding_2d(const torch::Tensor& w, const torch::Tensor& ids, int64_t vocab_begin,
                                 TensorGrid& g);
/// The whole activation [batch, ..., features] on every rank, from this
/// rank's block; backward keeps this rank's block of the gradient (for a
/// loss every rank computes alike on the whole output).
torch::Tensor gather_2d(const torch::Tensor& x, TensorGrid& g);

// --- 3D (CubeGrid, Note [3D linear] in layers_3d.cpp) -----------------------

/// A Linear's weight [out, in] (`fused` blocks of rows) for inputs on `input_side`.
torch::Tensor linear_3d_part(const torch::Tensor& w, const CubeGrid& g, Side3D input_side, int fused,
                             const std::string& what);
/// Its bias: output block (the input side's piece axis coordinate).
torch::Tensor linear_3d_bias_part(const torch::Tensor& b, const CubeGrid& g, Side3D input_side, int fused,
                                  const std::string& what);
/// A norm's weight or bias for activations on `side`: feature block (the side's feature axis coordinate).
torch::Tensor features_3d_part(const torch::Tensor& v, const CubeGrid& g, Side3D side, const std::string& what);
/// An Embedding's table for lookups onto `side`: piece i * d + (piece axis) of the dim's block (feature axis).
torch::Tensor embedding_3d_part(const torch::Tensor& w, const CubeGrid& g, Side3D side, const std::string& what);

torch::Tensor linear_3d(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, CubeGrid& g,
                        Side3D input_side);
torch::Tensor layer_norm_3d(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
                            int64_t features, double eps, CubeGrid& g, Side3D side);
torch::Tensor embedding_3d(const torch::Tensor& w, const torch::Tensor& ids, CubeGrid& g, Side3D side);
/// The whole activation on every rank from this rank's part on `side`; backward keeps this rank's part.
torch::Tensor gather_3d(const torch::Tensor& x, CubeGrid& g, Side3D side);

}  // namespace strata::parallel::grid_ops
