#pragma once
// Tensor parallelism, 3D (Agarwal's 3D matrix multiplication, Colossal-AI's
// 3D mode): layers over a d x d x d cube of ranks, each holding 1/d^3 of
// every activation and of every weight. docs/tensor_parallel.md.
//
// Rank (i, j, k) = (i * d + j) * d + k. An activation [batch, ..., features]
// is split into d^2 batch pieces and d feature blocks, on one of two sides:
//   side A: features block k, batch piece i * d + j;
//   side B: features block j, batch piece i * d + k.
// A Linear3D takes one side and gives the other (input and output groups
// swap between consecutive layers), so a block of an up and a down
// projection returns to its input's side. Its weight: rank (i, j, k) holds
// piece i (along the output features) of W[output block g, input block f],
// with f the input side's feature axis and g the other. Forward all-gathers
// the input over g's axis and the weight over i, multiplies, and
// reduce-scatters the product over f's axis; backward mirrors it (Note [3D
// linear] in layers_3d.cpp).
//
// Parameter gradients are sums over the batch pieces, as for one process
// with the whole batch: use a loss that is the mean over the whole batch
// (cross_entropy_3d) or the sum of each rank's part.

#include <torch/torch.h>

#include <memory>

#include "strata/parallel/communicator.h"

namespace strata::parallel {

enum class Side3D { kA, kB };

class CubeGrid {
 public:
  /// Splits `group` (d^3 ranks) into its axis and plane groups: collective
  /// over `group`, which must outlive the grid. A size that is not a cube is
  /// a clear error, before any collective.
  explicit CubeGrid(Communicator& group);

  int d() const { return d_; }
  int i() const { return i_; }
  int j() const { return j_; }
  int k() const { return k_; }
  Communicator& group() { return *group_; }
  /// The d ranks along axis 0 (i), 1 (j) or 2 (k) through this rank, numbered by that coordinate.
  Communicator& axis(int a) { return *axes_[a]; }
  /// The d^2 ranks sharing this rank's coordinate on axis 1 (j) or 2 (k),
  /// numbered i * d + (the other coordinate).
  Communicator& plane(int a) { return *planes_[a]; }
  int coord(int a) const { return a == 0 ? i_ : (a == 1 ? j_ : k_); }
  /// The axis holding a side's feature blocks (A: 2, k; B: 1, j), and its batch pieces (the other).
  static int feature_axis(Side3D s) { return s == Side3D::kA ? 2 : 1; }
  static int piece_axis(Side3D s) { return s == Side3D::kA ? 1 : 2; }
  static Side3D other(Side3D s) { return s == Side3D::kA ? Side3D::kB : Side3D::kA; }

  /// This rank's part of a whole activation [batch, ..., features] on `side`.
  torch::Tensor split(const torch::Tensor& whole, Side3D side) const;
  /// This rank's batch piece on `side` of a tensor without features (ids, targets).
  torch::Tensor split_batch(const torch::Tensor& whole, Side3D side) const;

 private:
  Communicator* group_;
  int d_ = 1, i_ = 0, j_ = 0, k_ = 0;
  std::unique_ptr<Communicator> axes_[3], planes_[3];
};

struct Linear3DImpl : torch::nn::Module {
  /// This rank's piece of an existing layer, for inputs on `input_side`
  /// (outputs on the other). The bias: output block g, on the d^2 ranks of g's plane.
  Linear3DImpl(const torch::nn::Linear& full, CubeGrid& grid, Side3D input_side);
  Linear3DImpl(int64_t in, int64_t out, CubeGrid& grid, Side3D input_side, bool bias = true);
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias;
  CubeGrid* grid;
  Side3D input_side;
};
TORCH_MODULE(Linear3D);

struct LayerNorm3DImpl : torch::nn::Module {
  /// Over the last dimension of activations on `side`: the statistics are
  /// all-reduced along its feature axis; gamma and beta are feature block
  /// `side`'s, on the d^2 ranks of that plane.
  LayerNorm3DImpl(const torch::nn::LayerNorm& full, CubeGrid& grid, Side3D side);
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias;
  int64_t features;
  double eps;
  CubeGrid* grid;
  Side3D side;
};
TORCH_MODULE(LayerNorm3D);

struct Embedding3DImpl : torch::nn::Module {
  /// Lookups onto `side`: rank (i, j, k) holds piece i * d + (piece axis
  /// coordinate) of the dim's block (feature axis coordinate); a lookup
  /// all-gathers the block over the plane (gradients reduce-scattered back).
  Embedding3DImpl(const torch::nn::Embedding& full, CubeGrid& grid, Side3D side);
  torch::Tensor forward(const torch::Tensor& ids);

  torch::Tensor weight;
  CubeGrid* grid;
  Side3D side;
};
TORCH_MODULE(Embedding3D);

/// Mean cross-entropy over the whole batch, on every rank, of logits [N/d^2,
/// V/d] on `side` (a Linear3D's output) against this rank's targets [N/d^2]:
/// vocab-parallel along the feature axis, averaged over the plane.
torch::Tensor cross_entropy_3d(const torch::Tensor& logits, const torch::Tensor& target, CubeGrid& grid, Side3D side);

}  // namespace strata::parallel
