#include "bench_torch.h"

#include <algorithm>
#include <chrono>
#include <vector>

#if defined(STRATA_HAVE_TORCH)
#include <torch/torch.h>
#endif

namespace strata::tools {

#if defined(STRATA_HAVE_TORCH)
bool torch_available() { return true; }

double torch_adamw_seconds(int64_t params, int threads, int iters) {
  torch::set_num_threads(threads);
  torch::NoGradGuard no_grad;
  torch::Tensor p = torch::randn({params});
  p.mutable_grad() = torch::randn({params}) * 1e-3;
  torch::optim::AdamW opt({p}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  opt.step();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto a = std::chrono::steady_clock::now();
    opt.step();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
#else
bool torch_available() { return false; }
double torch_adamw_seconds(int64_t, int, int) { return 0.0; }
#endif

}  // namespace strata::tools
