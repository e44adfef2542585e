// Tensor parallelism, 3D: the cube and its layers.
//
// Note [3D linear]
// Y = X W^T on a d x d x d cube. With the input on a side whose features are
// on axis f and batch pieces on axis g: rank (i, j, k) holds X[batch piece
// (i, c_g), input block c_f] and piece i of W[output block c_g, input block
// c_f]. All-gathering X over axis g gives X[batch block i, input block c_f];
// all-gathering W over axis 0 (i) gives W[output block c_g, input block c_f];
// their product is rank's share of Y[batch block i, output block c_g], summed
// over the input blocks by a reduce-scatter over axis f, which leaves piece
// (i, c_f) of it: output features on axis g, pieces on axis f, the other
// side. Backward is the transpose of each step: the reduce-scatter's
// gradient is all-gathered, the gathers' gradients reduce-scattered (the
// gathered tensors serve several batch blocks). Per layer each rank moves
// (d - 1)/d of its input, weight and output blocks forward, and the same
// backward.
#include "strata/parallel/tensor_parallel_3d.h"

#include <fmt/format.h>

#include <cmath>
#include <string>

#include "strata/core/error.h"
#include "strata/parallel/tensor_collectives.h"
#include "strata/parallel/tensor_parallel.h"
#include "grid_ops.h"
#include "../dispatch/placement.h"
#include "../comm/group_function.h"

namespace strata::parallel {

namespace {

using group_ops::AllReduceBoth;
using group_ops::GatherKept;
using group_ops::GatherSummed;
using group_ops::ReduceScatterGathered;

using GatherFirstSummed = GatherSummed<0>;
using GatherLastSummed = GatherSummed<-1>;
using ReduceScatterFirst = ReduceScatterGathered<0>;

int64_t cube_block(int64_t n, int parts, const std::string& what, const std::string& of = "") {
  return grid_ops::grid_block(n, parts, "3D", what, of);
}

}  // namespace

CubeGrid::CubeGrid(Communicator& group) : group_(&group) {
  const int p = group.world_size();
  d_ = static_cast<int>(std::lround(std::cbrt(static_cast<double>(p))));
  STRATA_CHECK(d_ * d_ * d_ == p, "3D tensor parallelism needs d x d x d ranks (8, 27, 64, ...); the tensor group has ",
               p, ": use 1D, 2D or 2.5D, or a tensor size that is a cube");
  const int r = group.rank();
  k_ = r % d_;
  j_ = (r / d_) % d_;
  i_ = r / (d_ * d_);
  const auto at = [&](int i, int j, int k) { return (i * d_ + j) * d_ + k; };
  std::vector<int> axes[3], planes[3];
  for (int c = 0; c < d_; ++c) {
    axes[0].push_back(at(c, j_, k_));
    axes[1].push_back(at(i_, c, k_));
    axes[2].push_back(at(i_, j_, c));
  }
  for (int a = 0; a < d_; ++a) {
    for (int b = 0; b < d_; ++b) {
      planes[1].push_back(at(a, j_, b));  // sharing j, numbered i * d + k
      planes[2].push_back(at(a, b, k_));  // sharing k, numbered i * d + j
    }
  }
  for (int a = 0; a < 3; ++a) {
    const int fixed[3] = {i_, j_, k_};
    std::string key;
    for (int b = 0; b < 3; ++b) key += b == a ? "*" : std::to_string(fixed[b]);
    axes_[a] = group.split(axes[a], "cube-axis-" + key);
  }
  planes_[1] = group.split(planes[1], fmt::format("cube-plane-j{}", j_));
  planes_[2] = group.split(planes[2], fmt::format("cube-plane-k{}", k_));
}

torch::Tensor CubeGrid::split_batch(const torch::Tensor& whole, Side3D side) const {
  const int64_t n = cube_block(whole.size(0), d_ * d_, "the batch");
  return whole.narrow(0, n * (i_ * d_ + coord(piece_axis(side))), n).contiguous();
}

torch::Tensor CubeGrid::split(const torch::Tensor& whole, Side3D side) const {
  const int64_t f = cube_block(whole.size(-1), d_, "the features");
  return split_batch(whole, side).narrow(-1, f * coord(feature_axis(side)), f).contiguous();
}

// --- the layers' arithmetic (grid_ops.h) -------------------------------------

namespace grid_ops {

torch::Tensor linear_3d_part(const torch::Tensor& w, const CubeGrid& g, Side3D input_side, int fused,
                             const std::string& what) {
  const int d = g.d();
  const int f = CubeGrid::feature_axis(input_side), o = CubeGrid::piece_axis(input_side);
  const int64_t in = cube_block(w.size(1), d, "the input features", what);
  const int64_t piece = cube_block(w.size(0) / d, d, "a block of the output features", what);
  torch::NoGradGuard no_grad;
  return fused_block_rows(w, fused, g.coord(o), d, "the output features", what)
      .narrow(0, piece * g.i(), piece)
      .narrow(1, in * g.coord(f), in)
      .clone();
}

torch::Tensor linear_3d_bias_part(const torch::Tensor& b, const CubeGrid& g, Side3D input_side, int fused,
                                  const std::string& what) {
  torch::NoGradGuard no_grad;
  return fused_block_rows(b, fused, g.coord(CubeGrid::piece_axis(input_side)), g.d(), "the bias", what).clone();
}

torch::Tensor features_3d_part(const torch::Tensor& v, const CubeGrid& g, Side3D side, const std::string& what) {
  const int64_t f = cube_block(v.size(0), g.d(), "the features", what);
  torch::NoGradGuard no_grad;
  return v.narrow(0, f * g.coord(CubeGrid::feature_axis(side)), f).clone();
}

torch::Tensor embedding_3d_part(const torch::Tensor& w, const CubeGrid& g, Side3D side, const std::string& what) {
  const int d = g.d();
  const int f = CubeGrid::feature_axis(side), o = CubeGrid::piece_axis(side);
  const int64_t dim = cube_block(w.size(1), d, "the embedding dim", what);
  const int64_t piece = cube_block(dim, d * d, "a block of the embedding dim", what);
  torch::NoGradGuard no_grad;
  return w.narrow(1, dim * g.coord(f) + piece * (g.i() * d + g.coord(o)), piece).clone();
}

torch::Tensor linear_3d(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, CubeGrid& g,
                        Side3D input_side) {
  // Note [3D linear].
  const int f = CubeGrid::feature_axis(input_side), o = CubeGrid::piece_axis(input_side);
  const torch::Tensor xg = GatherFirstSummed::apply(&g.axis(o), x);
  const torch::Tensor wg = GatherFirstSummed::apply(&g.axis(0), w);
  torch::Tensor y = ReduceScatterFirst::apply(&g.axis(f), torch::matmul(xg, wg.t()));
  return bias.defined() ? y + shared_over(bias, &g.plane(o)) : y;
}

torch::Tensor layer_norm_3d(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
                            int64_t features, double eps, CubeGrid& g, Side3D side) {
  const int f = CubeGrid::feature_axis(side);
  Communicator& across = g.axis(f);  // the other feature blocks of the same rows
  const torch::Tensor mean = AllReduceBoth::apply(&across, x.sum(-1, true)) / static_cast<double>(features);
  const torch::Tensor centred = x - mean;
  const torch::Tensor var =
      AllReduceBoth::apply(&across, (centred * centred).sum(-1, true)) / static_cast<double>(features);
  torch::Tensor y = centred * torch::rsqrt(var + eps) * shared_over(w, &g.plane(f));
  return bias.defined() ? y + shared_over(bias, &g.plane(f)) : y;
}

torch::Tensor embedding_3d(const torch::Tensor& w, const torch::Tensor& ids, CubeGrid& g, Side3D side) {
  // The plane of this feature block holds its d^2 pieces, numbered i * d + (piece axis).
  return torch::embedding(GatherLastSummed::apply(&g.plane(CubeGrid::feature_axis(side)), w), ids);
}

torch::Tensor gather_3d(const torch::Tensor& x, CubeGrid& g, Side3D side) {
  // The feature axis holds the feature blocks in order, the plane of the
  // feature axis's coordinate the batch pieces, numbered i * d + (piece axis).
  // Features last, as gather_2d does.
  const int f = CubeGrid::feature_axis(side);
  return GatherKept<-1>::apply(&g.axis(f), GatherKept<0>::apply(&g.plane(f), x));
}

}  // namespace grid_ops

Linear3DImpl::Linear3DImpl(int64_t in, int64_t out, CubeGrid& g, Side3D side, bool with_bias)
    : Linear3DImpl(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(with_bias)), g, side) {}

Linear3DImpl::Linear3DImpl(const torch::nn::Linear& full, CubeGrid& g, Side3D side) : grid(&g), input_side(side) {
  checkpoint::PartMap bias_map, weight_map;
  weight = register_parameter("weight", tensor_layout::cut_part(full->weight, [&](const torch::Tensor& t) {
    return grid_ops::linear_3d_part(t, g, side, 1, "a Linear3D");
  }, &weight_map));
  tensor_layout::place(weight, g.group(), 1, nullptr, weight_map);
  if (full->bias.defined()) {
    bias = register_parameter("bias", tensor_layout::cut_part(full->bias, [&](const torch::Tensor& t) {
      return grid_ops::linear_3d_bias_part(t, g, side, 1, "a Linear3D");
    }, &bias_map));
    tensor_layout::place(bias, g.group(), g.d() * g.d(), nullptr, bias_map);
  }
}

torch::Tensor Linear3DImpl::forward(const torch::Tensor& x) {
  return grid_ops::linear_3d(x, weight, bias, *grid, input_side);
}

LayerNorm3DImpl::LayerNorm3DImpl(const torch::nn::LayerNorm& full, CubeGrid& g, Side3D s) : grid(&g), side(s) {
  checkpoint::PartMap bias_map, weight_map;
  const auto& shape = full->options.normalized_shape();
  STRATA_CHECK(shape.size() == 1 && full->options.elementwise_affine(), "LayerNorm3D normalises over the last "
               "dimension with a weight and a bias");
  features = shape[0];
  eps = full->options.eps();
  weight = register_parameter("weight", tensor_layout::cut_part(full->weight, [&](const torch::Tensor& t) {
    return grid_ops::features_3d_part(t, g, s, "a LayerNorm3D");
  }, &weight_map));
  bias = register_parameter("bias", tensor_layout::cut_part(full->bias, [&](const torch::Tensor& t) {
    return grid_ops::features_3d_part(t, g, s, "a LayerNorm3D");
  }, &bias_map));
  tensor_layout::place(weight, g.group(), g.d() * g.d(), nullptr, weight_map);
  tensor_layout::place(bias, g.group(), g.d() * g.d(), nullptr, bias_map);
}

torch::Tensor LayerNorm3DImpl::forward(const torch::Tensor& x) {
  return grid_ops::layer_norm_3d(x, weight, bias, features, eps, *grid, side);
}

Embedding3DImpl::Embedding3DImpl(const torch::nn::Embedding& full, CubeGrid& g, Side3D s) : grid(&g), side(s) {
  checkpoint::PartMap weight_map;
  weight = register_parameter("weight", tensor_layout::cut_part(full->weight, [&](const torch::Tensor& t) {
    return grid_ops::embedding_3d_part(t, g, s, "an Embedding3D");
  }, &weight_map));
  tensor_layout::place(weight, g.group(), 1, nullptr, weight_map);
}

torch::Tensor Embedding3DImpl::forward(const torch::Tensor& ids) {
  return grid_ops::embedding_3d(weight, ids, *grid, side);
}

torch::Tensor cross_entropy_3d(const torch::Tensor& logits, const torch::Tensor& target, CubeGrid& grid, Side3D side) {
  const int f = CubeGrid::feature_axis(side);
  const torch::Tensor mine = vocab_parallel_cross_entropy(logits, target, grid.axis(f));
  return reduce_from_group(mine, grid.plane(f)) / static_cast<double>(grid.d() * grid.d());
}

}  // namespace strata::parallel
