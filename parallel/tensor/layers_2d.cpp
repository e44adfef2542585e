// Tensor parallelism, 2D (SUMMA) and 2.5D (Tesseract): the grid and its layers.
//
// Note [SUMMA]
// Y = X W^T on a q x q grid: rank (i, j) holds X_ij (batch block i, input
// feature block j) and W[output block j, input block i], and computes
// Y_ij = sum_k X_ik W[j, k]^T. Step k broadcasts X_ik along row i (from
// rank (i, k)) and W[j, k] along column j (from rank (k, j)); every rank
// multiplies the two and accumulates. The broadcasts of step k + 1 are posted
// before step k multiplies (two buffers), so communication overlaps the
// products. Backward repeats the broadcasts and forms, at every rank, step
// k's share of both gradients: dY_ij W[j, k] (of dX_ik) and dY_ij^T X_ik (of
// dW[j, k]); one reduce-scatter along the row sums the first at rank (i, k),
// one along the column sums the second at rank (k, j). 2.5D runs this on
// each depth slice, the weight's gradient then all-reduced over the depth
// group (Colossal-AI's Tesseract layers leave that out; their tests run
// depth 1 only).
#include "strata/parallel/tensor_parallel_2d.h"

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

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using group_ops::all_gather_dim;
using group_ops::AllReduceBoth;
using group_ops::GatherKept;
using group_ops::GatherSummed;
using group_ops::host_buffer;
using group_ops::reduce_scatter_stacked;
using group_ops::ReduceScatterGathered;
using group_ops::vocab_block_rows;

using GatherLastSummed = GatherSummed<-1>;
using ReduceScatterFirst = ReduceScatterGathered<0>;

TensorGrid& grid_of(AutogradContext* ctx) {
  return *reinterpret_cast<TensorGrid*>(static_cast<intptr_t>(ctx->saved_data["grid"].toInt()));
}

// Note [SUMMA]: step(k, X_ik, W[j, k]) for k = 0..q-1, the broadcasts of k + 1 in flight during step k.
template <class Step>
void summa_steps(TensorGrid& g, const torch::Tensor& x, const torch::Tensor& w, const Step& step) {
  const torch::Tensor xh = host_buffer(x), wh = host_buffer(w);
  torch::Tensor xb[2], wb[2];
  WorkHandle hx[2], hw[2];
  const auto post = [&](int k) {
    const int s = k % 2;
    xb[s] = g.col() == k ? xh : torch::empty_like(xh);  // the root's buffer is only read
    wb[s] = g.row() == k ? wh : torch::empty_like(wh);
    hx[s] = broadcast(g.rows(), xb[s], k);
    hw[s] = broadcast(g.cols(), wb[s], k);
  };
  post(0);
  for (int k = 0; k < g.q(); ++k) {
    if (k + 1 < g.q()) post(k + 1);
    const int s = k % 2;
    hx[s]->wait();
    hw[s]->wait();
    step(k, xb[s].to(x.device(), x.scalar_type()), wb[s].to(w.device(), w.scalar_type()));
  }
}

struct Summa : torch::autograd::Function<Summa> {
  static torch::Tensor forward(AutogradContext* ctx, TensorGrid* g, const torch::Tensor& x, const torch::Tensor& w) {
    ctx->saved_data["grid"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(g));
    ctx->save_for_backward({x, w});
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = w.size(0);
    torch::Tensor y = torch::zeros(shape, x.options());
    summa_steps(*g, x, w, [&](int, const torch::Tensor& xk, const torch::Tensor& wk) {
      y.add_(torch::matmul(xk, wk.t()));
    });
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TensorGrid& g = grid_of(ctx);
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& w = saved[1];
    const torch::Tensor dy = grads[0].contiguous();
    const torch::Tensor dy2 = dy.reshape({-1, dy.size(-1)});
    std::vector<torch::Tensor> dx_parts(g.q()), dw_parts(g.q());
    summa_steps(g, x, w, [&](int k, const torch::Tensor& xk, const torch::Tensor& wk) {
      dx_parts[k] = torch::matmul(dy, wk);
      dw_parts[k] = torch::matmul(dy2.t(), xk.reshape({-1, xk.size(-1)}));
    });
    torch::Tensor dx = reduce_scatter_stacked(torch::stack(dx_parts, 0), g.rows());
    torch::Tensor dw = reduce_scatter_stacked(torch::stack(dw_parts, 0), g.cols());
    return {torch::Tensor(), dx, dw};
  }
};

// A parameter the same on `group`'s ranks whose uses see different data:
// its gradient is summed over the group (f of Note [Megatron's f and g]).
int64_t block(int64_t n, int parts, const std::string& what, const std::string& of = "") {
  return grid_ops::grid_block(n, parts, "2D", what, of);
}

}  // namespace

TensorGrid::TensorGrid(Communicator& group, int depth) : group_(&group), d_(depth) {
  const int p = group.world_size();
  STRATA_CHECK(depth >= 1 && p % depth == 0, "a tensor grid of depth ", depth, " needs a multiple of ", depth,
               " ranks; the tensor group has ", p);
  q_ = static_cast<int>(std::lround(std::sqrt(static_cast<double>(p / depth))));
  STRATA_CHECK(q_ * q_ * depth == p, depth == 1 ? "2D" : "2.5D", " tensor parallelism needs q x q",
               depth == 1 ? "" : " x depth", " ranks (4, 9, 16, ...", depth == 1 ? "" : " times the depth",
               "); the tensor group has ", p, depth == 1 ? "" : fmt::format(" at depth {}", depth),
               ": use 1D, or a tensor size that is a square", depth == 1 ? "" : " times the depth");
  const int r = group.rank();
  col_ = r % q_;
  row_ = (r / q_) % q_;
  k_ = r / (q_ * q_);
  const auto at = [&](int k, int i, int j) { return (k * q_ + i) * q_ + j; };
  std::vector<int> rows, cols, depths, batch;
  for (int j = 0; j < q_; ++j) rows.push_back(at(k_, row_, j));
  for (int i = 0; i < q_; ++i) cols.push_back(at(k_, i, col_));
  for (int k = 0; k < d_; ++k) depths.push_back(at(k, row_, col_));
  for (int k = 0; k < d_; ++k) {
    for (int i = 0; i < q_; ++i) batch.push_back(at(k, i, col_));
  }
  rows_ = group.split(rows, fmt::format("grid-row-{}-{}", k_, row_));
  cols_ = group.split(cols, fmt::format("grid-col-{}-{}", k_, col_));
  if (d_ > 1) depths_ = group.split(depths, fmt::format("grid-depth-{}-{}", row_, col_));
  batch_ = group.split(batch, fmt::format("grid-batch-{}", col_));
}

torch::Tensor TensorGrid::split_batch(const torch::Tensor& whole) const {
  const int64_t n = block(whole.size(0), batch_blocks(), "the batch");
  return whole.narrow(0, n * batch_block(), n).contiguous();
}

torch::Tensor TensorGrid::split(const torch::Tensor& whole) const {
  const int64_t f = block(whole.size(-1), q_, "the features");
  return split_batch(whole).narrow(-1, f * col_, f).contiguous();
}

// --- the layers' arithmetic (grid_ops.h) -------------------------------------

namespace grid_ops {

int64_t grid_block(int64_t n, int parts, const char* layout, const std::string& what, const std::string& of) {
  STRATA_CHECK(n % parts == 0, layout, " tensor parallelism splits ", what, " (", n, ")",
               of.empty() ? "" : " of " + of, " into ", parts, " equal blocks; choose sizes divisible by ", parts);
  return n / parts;
}

torch::Tensor shared_over(const torch::Tensor& p, Communicator* group) {
  return group == nullptr || group->world_size() == 1 ? p : copy_to_group(p, *group);
}

torch::Tensor fused_block_rows(const torch::Tensor& t, int fused, int index, int parts, const std::string& what,
                               const std::string& of) {
  STRATA_CHECK(fused >= 1 && t.size(0) % (static_cast<int64_t>(fused) * parts) == 0, "tensor parallelism splits ",
               what, " (", t.size(0), fused > 1 ? fmt::format(" in {} fused blocks", fused) : std::string(), ") of ", of,
               " into ", parts, " equal blocks", fused > 1 ? " each" : "", "; choose sizes divisible by ",
               static_cast<int64_t>(fused) * parts);
  if (fused == 1) return t.narrow(0, t.size(0) / parts * index, t.size(0) / parts);
  const int64_t each = t.size(0) / fused, slice = each / parts;
  std::vector<torch::Tensor> rows;
  for (int f = 0; f < fused; ++f) rows.push_back(t.narrow(0, f * each + slice * index, slice));
  return torch::cat(rows, 0);
}

torch::Tensor linear_2d_part(const torch::Tensor& w, const TensorGrid& g, int fused, const std::string& what) {
  const int64_t in = block(w.size(1), g.q(), "the input features", what);
  torch::NoGradGuard no_grad;
  return fused_block_rows(w, fused, g.col(), g.q(), "the output features", what)
      .narrow(1, in * g.row(), in)
      .clone();
}

torch::Tensor features_2d_part(const torch::Tensor& v, const TensorGrid& g, int fused, const std::string& what) {
  torch::NoGradGuard no_grad;
  return fused_block_rows(v, fused, g.col(), g.q(), "the features", what).clone();
}

torch::Tensor embedding_2d_part(const torch::Tensor& w, const TensorGrid& g, const std::string& what) {
  const int q = g.q();
  const int64_t part = block(w.size(1), q * q, "the embedding dim", what);
  torch::NoGradGuard no_grad;
  return w.narrow(1, part * (g.col() * q + g.row()), part).clone();
}

torch::Tensor vocab_embedding_2d_part(const torch::Tensor& w, const TensorGrid& g, int64_t* vocab_begin,
                                      const std::string& what) {
  const int64_t vocab = block(w.size(0), g.q(), "the vocabulary", what);
  const int64_t dim = block(w.size(1), g.q(), "the embedding dim", what);
  *vocab_begin = vocab * g.row();
  torch::NoGradGuard no_grad;
  return w.narrow(0, *vocab_begin, vocab).narrow(1, dim * g.col(), dim).clone();
}

torch::Tensor linear_2d(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, TensorGrid& g) {
  torch::Tensor y = Summa::apply(&g, x, shared_over(w, g.depths()));
  return bias.defined() ? y + shared_over(bias, &g.batch()) : y;
}

torch::Tensor layer_norm_2d(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
                            int64_t features, double eps, TensorGrid& g) {
  // The row holds the whole feature dimension: its sums are all-reduced along it.
  const torch::Tensor mean = AllReduceBoth::apply(&g.rows(), x.sum(-1, true)) / static_cast<double>(features);
  const torch::Tensor centred = x - mean;
  const torch::Tensor var =
      AllReduceBoth::apply(&g.rows(), (centred * centred).sum(-1, true)) / static_cast<double>(features);
  torch::Tensor y = centred * torch::rsqrt(var + eps) * shared_over(w, &g.batch());
  return bias.defined() ? y + shared_over(bias, &g.batch()) : y;
}

torch::Tensor embedding_2d(const torch::Tensor& w, const torch::Tensor& ids, TensorGrid& g) {
  // The column's q blocks are this column's feature block; each row looks up its own batch.
  return torch::embedding(GatherLastSummed::apply(&g.cols(), shared_over(w, g.depths())), ids);
}

torch::Tensor vocab_embedding_2d(const torch::Tensor& w, const torch::Tensor& ids, int64_t vocab_begin,
                                 TensorGrid& g) {
  // Every batch block of the column, looked up in this rank's vocabulary block.
  // Ids travel bit for bit, as pairs of fp32 words (Gloo moves floats).
  const torch::Tensor words = ids.to(torch::kLong).contiguous().view(torch::kFloat32);
  const torch::Tensor all = all_gather_dim<0>(words, g.cols()).contiguous().view(torch::kLong);
  const torch::Tensor rows = vocab_block_rows(shared_over(w, g.depths()), all, vocab_begin);
  return ReduceScatterFirst::apply(&g.cols(), rows);
}

torch::Tensor gather_2d(const torch::Tensor& x, TensorGrid& g) {
  // The batch group holds the batch blocks in block order, the row the
  // feature blocks in column order. The features last: their gather
  // concatenates into a new tensor, which a caller may add to in place
  // (LibTorch 1.13's F::linear adds the bias so), where the batch's would be
  // a view of the gather's buffer.
  return GatherKept<-1>::apply(&g.rows(), GatherKept<0>::apply(&g.batch(), x));
}

}  // namespace grid_ops

// --- layers ------------------------------------------------------------------

Linear2DImpl::Linear2DImpl(int64_t in, int64_t out, TensorGrid& g, bool with_bias)
    : Linear2DImpl(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(with_bias)), g) {}

Linear2DImpl::Linear2DImpl(const torch::nn::Linear& full, TensorGrid& g) : grid(&g) {
  checkpoint::PartMap bias_map, weight_map;
  weight = register_parameter("weight", tensor_layout::cut_part(full->weight, [&](const torch::Tensor& t) {
    return grid_ops::linear_2d_part(t, g, 1, "a Linear2D");
  }, &weight_map));
  tensor_layout::place(weight, g.group(), g.depth(), nullptr, weight_map);
  if (full->bias.defined()) {
    bias = register_parameter("bias", tensor_layout::cut_part(full->bias, [&](const torch::Tensor& t) {
      return grid_ops::features_2d_part(t, g, 1, "a Linear2D's bias");
    }, &bias_map));
    tensor_layout::place(bias, g.group(), g.batch_blocks(), nullptr, bias_map);
  }
}

torch::Tensor Linear2DImpl::forward(const torch::Tensor& x) { return grid_ops::linear_2d(x, weight, bias, *grid); }

LayerNorm2DImpl::LayerNorm2DImpl(const torch::nn::LayerNorm& full, TensorGrid& g) : grid(&g) {
  checkpoint::PartMap bias_map, weight_map;
  const auto& shape = full->options.normalized_shape();
  STRATA_CHECK(shape.size() == 1 && full->options.elementwise_affine(), "LayerNorm2D normalises over the last "
               "dimension with a weight and a bias; this LayerNorm has normalized_shape of ", shape.size(),
               " dimensions", full->options.elementwise_affine() ? "" : " and no affine parameters");
  features = shape[0];
  eps = full->options.eps();
  weight = register_parameter("weight", tensor_layout::cut_part(full->weight, [&](const torch::Tensor& t) {
    return grid_ops::features_2d_part(t, g, 1, "a LayerNorm2D");
  }, &weight_map));
  bias = register_parameter("bias", tensor_layout::cut_part(full->bias, [&](const torch::Tensor& t) {
    return grid_ops::features_2d_part(t, g, 1, "a LayerNorm2D");
  }, &bias_map));
  tensor_layout::place(weight, g.group(), g.batch_blocks(), nullptr, weight_map);
  tensor_layout::place(bias, g.group(), g.batch_blocks(), nullptr, bias_map);
}

torch::Tensor LayerNorm2DImpl::forward(const torch::Tensor& x) {
  return grid_ops::layer_norm_2d(x, weight, bias, features, eps, *grid);
}

Embedding2DImpl::Embedding2DImpl(const torch::nn::Embedding& full, TensorGrid& g) : grid(&g) {
  checkpoint::PartMap weight_map;
  weight = register_parameter("weight", tensor_layout::cut_part(full->weight, [&](const torch::Tensor& t) {
    return grid_ops::embedding_2d_part(t, g, "an Embedding2D");
  }, &weight_map));
  tensor_layout::place(weight, g.group(), g.depth(), nullptr, weight_map);
}

torch::Tensor Embedding2DImpl::forward(const torch::Tensor& ids) { return grid_ops::embedding_2d(weight, ids, *grid); }

VocabEmbedding2DImpl::VocabEmbedding2DImpl(const torch::nn::Embedding& full, TensorGrid& g) : grid(&g) {
  checkpoint::PartMap weight_map;
  weight = register_parameter("weight", tensor_layout::cut_part(full->weight, [&](const torch::Tensor& t) {
    return grid_ops::vocab_embedding_2d_part(t, g, &vocab_begin, "a VocabEmbedding2D");
  }, &weight_map));
  tensor_layout::place(weight, g.group(), g.depth(), nullptr, weight_map);
}

torch::Tensor VocabEmbedding2DImpl::forward(const torch::Tensor& ids) {
  return grid_ops::vocab_embedding_2d(weight, ids, vocab_begin, *grid);
}

torch::Tensor cross_entropy_2d(const torch::Tensor& logits, const torch::Tensor& target, TensorGrid& grid) {
  const torch::Tensor mine = vocab_parallel_cross_entropy(logits, target, grid.rows());
  return reduce_from_group(mine, grid.batch()) / static_cast<double>(grid.batch_blocks());
}

}  // namespace strata::parallel
