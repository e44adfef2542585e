#pragma once
// Parameters that parallelize() split in place, and the operators that take a
// tensor-parallel form on them. Private to strata_parallel.
//
// Note [Tensor-parallel operators on unmodified modules]
// parallelize() cannot change an unmodified module's forward: a
// torch::nn::LinearImpl calls F::linear(x, weight, bias) whatever its weight
// holds. So the split parameter itself carries the layout, as PyTorch's
// DTensor does: its TensorImpl gets the dispatch key TESTING_ONLY_GenericWrapper
// (the engine's OpHook uses GenericMode, one above it, so the two stack:
// the hook makes the parameter resident, then the layout runs the operator),
// and a boxed fallback for that key looks the parameter up here. Operators
// that use it as a linear layer's weight or an embedding table run in their
// tensor-parallel form (the Placement's), with the key excluded below them,
// so the form's own operators record autograd as usual:
//   - aten::linear(x, W, b) (LibTorch 2.x's F::linear) and aten::embedding(W, ...);
//   - LibTorch 1.13's F::linear, which is addmm(b, x, W.t()) for a 2-D input
//     with a bias and matmul(x, W.t()) (then += b) otherwise: aten::t on a
//     placed parameter registers its result as the transposed weight, and
//     aten::addmm and aten::matmul with that as their right operand are the
//     linear layer;
//   - aten::layer_norm(x, shape, W, b, eps) (LibTorch's F::layer_norm, both versions);
//   - aten::add and add_ with the parameter as the other operand (1.13's
//     F::linear adds the bias so, after the matmul).
// Every other operator (views, the optimizer's updates, autograd's backward
// kernels) passes through unchanged, and sees this rank's part.
// Tensor::set_data replaces a tensor's key set: the engine restores the key
// (OpHook::mark calls restore_placement_key).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <functional>
#include <memory>
#include <optional>

#include "strata/checkpoint/part_map.h"
#include "strata/parallel/communicator.h"

namespace strata::parallel::tensor_layout {

/// How operators on one split parameter run.
class Placement {
 public:
  virtual ~Placement() = default;
  /// y = x W^T (+ bias) with W this parameter: `weight()` makes this rank's
  /// part of W [out, in] (autograd reaching the parameter; LibTorch 1.13's
  /// path holds W^T, so it costs an operator: call it only when needed), and
  /// `local_product(x')` is x' times it transposed, as the operator would
  /// have computed it; `bias` is the operator's (null: none). Returns the
  /// tensor-parallel result, or nullopt when W is not used so.
  virtual c10::optional<at::Tensor> linear(const at::Tensor& x, const std::function<at::Tensor()>& weight,
                                           const std::function<at::Tensor(const at::Tensor&)>& local_product,
                                           const c10::optional<at::Tensor>& bias) const {
    (void)x, (void)weight, (void)local_product, (void)bias;
    return c10::nullopt;
  }
  /// aten::layer_norm with this parameter as the weight, or nullopt.
  virtual c10::optional<at::Tensor> layer_norm(const at::Tensor& x, c10::IntArrayRef shape, const at::Tensor& weight,
                                               const c10::optional<at::Tensor>& bias, double eps) const {
    (void)x, (void)shape, (void)weight, (void)bias, (void)eps;
    return c10::nullopt;
  }
  /// self + alpha * this parameter (aten::add, or aten::add_ when `in_place`), or nullopt.
  virtual c10::optional<at::Tensor> add(const at::Tensor& self, const at::Tensor& param, const c10::Scalar& alpha,
                                        bool in_place) const {
    (void)self, (void)param, (void)alpha, (void)in_place;
    return c10::nullopt;
  }
  /// aten::embedding with this parameter as the table, or nullopt.
  virtual c10::optional<at::Tensor> embedding(const at::Tensor& weight, const at::Tensor& ids, int64_t padding_idx,
                                              bool scale_grad_by_freq, bool sparse) const {
    (void)weight, (void)ids, (void)padding_idx, (void)scale_grad_by_freq, (void)sparse;
    return c10::nullopt;
  }
};

/// `param` holds this rank's part of a parameter split over `group`,
/// identical on `copies` ranks of the group (1: a unique slice); `placement`
/// (may be null) gives operators on it their tensor-parallel form; `map`
/// says where the part lies in the whole parameter (Note [Parts of a whole
/// parameter] in part_map.h; none: only this layout can load its checkpoints).
void place(const at::Tensor& param, Communicator& group, int copies, std::shared_ptr<const Placement> placement,
           std::optional<checkpoint::PartMap> map);

/// How a layer takes its part of a whole parameter: selections only
/// (narrow, cat, clone, contiguous), which work on any dtype.
using Cut = std::function<at::Tensor(const at::Tensor&)>;
/// Where cut(whole) lies in a whole of `whole_shape`: the same cut applied to
/// the whole's element indices.
checkpoint::PartMap map_of_cut(at::IntArrayRef whole_shape, const Cut& cut);
/// cut(whole), cloned, and `map` set to where it lies.
at::Tensor cut_part(const at::Tensor& whole, const Cut& cut, checkpoint::PartMap* map);
/// The map place() recorded for `param`, if any.
std::optional<checkpoint::PartMap> part_map_of(const at::Tensor& param);

/// Puts the layout's dispatch key back on `t` when it has a placement
/// (after Tensor::set_data).
void restore_placement_key(const at::Tensor& t);

}  // namespace strata::parallel::tensor_layout
