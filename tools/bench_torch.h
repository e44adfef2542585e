#pragma once
// LibTorch baselines for `strata bench`, kept in their own translation unit so
// the rest of the tool never includes <torch/torch.h>.

#include <cstdint>

namespace strata::tools {

bool torch_available();
/// Median seconds of one torch::optim::AdamW step over `params` fp32 parameters.
double torch_adamw_seconds(int64_t params, int threads, int iters);

}  // namespace strata::tools
