#pragma once
// Tensor parallelism, 2D (SUMMA, Optimus) and 2.5D (Tesseract): the
// Colossal-AI paper's multi-dimensional modes, as layer modules over a
// TensorGrid. docs/tensor_parallel.md.
//
// The grid: a tensor group of q x q x d ranks (d = 1: 2D), rank = (depth * q
// + row) * q + col. Activations are split two ways: the batch into q x d
// blocks (rank (row, col, depth) holds block depth * q + row, the same on
// every column) and the features into q blocks (column col holds block col),
// so each rank holds 1/(q^2 d) of every activation. A linear layer's weight is
// split q x q: rank (row, col) holds W[output block col, input block row], the
// same on every depth (its gradient is all-reduced over the depth group).
//
// Parameter gradients are sums over the batch blocks, as for one process
// with the whole batch: use a loss that is the mean over the whole batch
// (cross_entropy_2d) or the sum of each rank's part. Each parameter records
// how many ranks hold the same part (tensor_copies_of), so the engine's
// gradient-norm clipping counts it once.

#include <torch/torch.h>

#include <memory>

#include "strata/parallel/communicator.h"

namespace strata::parallel {

class TensorGrid {
 public:
  /// Splits `group` (q^2 * depth ranks) into its row, column, depth and batch
  /// groups: collective over `group`, which must outlive the grid. A size that
  /// is not q^2 * depth is a clear error, before any collective.
  explicit TensorGrid(Communicator& group, int depth = 1);

  int q() const { return q_; }
  int depth() const { return d_; }
  int row() const { return row_; }
  int col() const { return col_; }
  int depth_index() const { return k_; }
  /// The q ranks of this rank's row (same depth), numbered by column.
  Communicator& rows() { return *rows_; }
  /// The q ranks of this rank's column (same depth), numbered by row.
  Communicator& cols() { return *cols_; }
  /// The d ranks holding the same weight blocks, numbered by depth (null when d = 1).
  Communicator* depths() { return depths_.get(); }
  /// The q * d ranks of this column over every depth, numbered by batch block:
  /// together they hold the whole batch.
  Communicator& batch() { return *batch_; }
  Communicator& group() { return *group_; }
  /// The batch block this rank holds, of batch_blocks().
  int batch_block() const { return k_ * q_ + row_; }
  int batch_blocks() const { return q_ * d_; }

  /// This rank's block of a whole activation [batch, ..., features]: batch
  /// block batch_block(), feature block col(). Its inverse, gather_2d, is for tests and evaluation.
  torch::Tensor split(const torch::Tensor& whole) const;
  /// This rank's batch block of a tensor without a feature dimension (token ids, targets).
  torch::Tensor split_batch(const torch::Tensor& whole) const;

 private:
  Communicator* group_;
  int q_ = 1, d_ = 1, row_ = 0, col_ = 0, k_ = 0;
  std::unique_ptr<Communicator> rows_, cols_, depths_, batch_;
};

struct Linear2DImpl : torch::nn::Module {
  /// This rank's block of a torch::nn::Linear(in, out) built here with
  /// LibTorch's initialisation (the same values as one process with the same seed).
  Linear2DImpl(int64_t in, int64_t out, TensorGrid& grid, bool bias = true);
  /// This rank's block of an existing layer: weight [out/q, in/q] (output
  /// block col, input block row), bias [out/q] (block col, on every row).
  Linear2DImpl(const torch::nn::Linear& full, TensorGrid& grid);
  /// x [batch/(q d), ..., in/q] -> [batch/(q d), ..., out/q]: SUMMA, x's
  /// blocks broadcast along rows and the weight's along columns, the next
  /// step's broadcasts in flight while this step multiplies; backward
  /// broadcasts the same and reduce-scatters the products (Note [SUMMA]).
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias;
  TensorGrid* grid;
};
TORCH_MODULE(Linear2D);

struct LayerNorm2DImpl : torch::nn::Module {
  /// Normalises over the last dimension, split over the row: the mean and
  /// variance are all-reduced along it. gamma and beta [features/q] (block col).
  LayerNorm2DImpl(const torch::nn::LayerNorm& full, TensorGrid& grid);
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias;
  int64_t features;
  double eps;
  TensorGrid* grid;
};
TORCH_MODULE(LayerNorm2D);

struct Embedding2DImpl : torch::nn::Module {
  /// The embedding dim split q^2 ways: rank (row, col) holds columns block
  /// col * q + row of [vocab, dim]; a lookup all-gathers the column's blocks
  /// (the rows' gradients reduce-scattered back). ids [batch/(q d), ...] ->
  /// [batch/(q d), ..., dim/q].
  Embedding2DImpl(const torch::nn::Embedding& full, TensorGrid& grid);
  torch::Tensor forward(const torch::Tensor& ids);

  torch::Tensor weight;
  TensorGrid* grid;
};
TORCH_MODULE(Embedding2D);

struct VocabEmbedding2DImpl : torch::nn::Module {
  /// The vocabulary split over the column and the dim over the row: rank
  /// (row, col) holds W[vocab block row, dim block col]. The column's ids are
  /// all-gathered, each rank looks up its vocabulary block for all of them,
  /// and the rows are reduce-scattered back to their batch blocks.
  VocabEmbedding2DImpl(const torch::nn::Embedding& full, TensorGrid& grid);
  torch::Tensor forward(const torch::Tensor& ids);

  torch::Tensor weight;
  int64_t vocab_begin = 0;
  TensorGrid* grid;
};
TORCH_MODULE(VocabEmbedding2D);

/// The classifier's loss: logits [N/(q d), V/q] (a Linear2D's output: batch
/// block, vocabulary block col) against targets [N/(q d)] (this rank's batch
/// block), the mean cross-entropy over the whole batch on every rank, the
/// logits never gathered (vocab-parallel over the row, then averaged over
/// the batch group).
torch::Tensor cross_entropy_2d(const torch::Tensor& logits, const torch::Tensor& target, TensorGrid& grid);

}  // namespace strata::parallel
