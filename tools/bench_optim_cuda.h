#pragma once
// The CUDA rows of `strata bench optim`: the device kernels against a
// device-to-device copy moving the same bytes, timed with CUDA events.
// Built when strata has its CUDA kernels (STRATA_HAVE_CUDA_KERNELS).

#include <cstdint>
#include <string>
#include <vector>

namespace strata::tools {

struct CudaOptimRow {
  std::string optimizer, grad, param;
  double params_per_s = 0.0;
  double gbps = 0.0;        // bytes the update reads and writes, per second
  double probe_gbps = 0.0;  // cudaMemcpy device to device of the same bytes: the ceiling
  double ratio = 0.0;       // probe time / kernel time
};

/// Every optimizer in fp32 and bf16 over `params` parameters on CUDA device 0;
/// throws strata::Error when there is none.
std::vector<CudaOptimRow> run_cuda_optim_rows(int64_t params, int iters);

}  // namespace strata::tools
