#pragma once
// What parallelize()'s two halves share: the 1D styles (parallelize.cpp) and
// the grid modes (parallelize_grid.cpp). Private to strata_parallel.

#include <torch/torch.h>

#include <string>
#include <vector>

#include "strata/parallel/parallelize.h"
#include "../dispatch/placement.h"

namespace strata::parallel::tensor_layout {

/// The plan entry each of `named` (a module's named_modules(), in order)
/// matches, or -1. Refuses a name two entries match and an entry that
/// matches no name.
std::vector<int> match_plan(const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& named,
                            const ParallelPlan& plan);
/// The elements of `module`'s parameters.
int64_t parameter_elements(torch::nn::Module& module);
/// "columnwise", "rowwise", ...
const char* kind_name(ParallelStyle::Kind kind);
/// Refuses a parameter an engine owns already, or one a tensor layout split already.
void check_unsplit(const torch::Tensor& param, const std::string& module);
/// Replaces a parameter's data by `part` (the same parameter object, smaller).
void replace_data(torch::Tensor& param, const torch::Tensor& part);

/// A parameter the same on every rank of `group`, added to activations that
/// differ across it (a bias on sequence shards or on batch blocks): its
/// gradient is summed over the group. `owner` keeps alive what owns `group`
/// (a grid's subgroups), for as long as the parameter is placed.
struct SummedAdd final : Placement {
  Communicator* group;
  std::shared_ptr<const void> owner;
  explicit SummedAdd(Communicator& g, std::shared_ptr<const void> keep = nullptr) : group(&g), owner(std::move(keep)) {}
  c10::optional<at::Tensor> add(const at::Tensor& self, const at::Tensor& param, const c10::Scalar& alpha,
                                bool in_place) const override;
};

}  // namespace strata::parallel::tensor_layout
