#include "bench_optim_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "strata/core/cuda_check.h"
#include "strata/core/dtype.h"
#include "strata/core/error.h"
#include "strata/kernels/cuda_optim.h"

namespace strata::tools {

namespace {

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    STRATA_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "allocating ", bytes, " bytes for bench optim");
    STRATA_CUDA_CHECK(cudaMemset(p, 0, std::max<size_t>(bytes, 1)), "zeroing the bench buffers");
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Median milliseconds of `fn` on the default stream over `iters` runs, after one warm-up.
template <class Fn>
double median_ms(int iters, Fn fn) {
  cudaEvent_t a, b;
  STRATA_CUDA_CHECK(cudaEventCreate(&a), "creating a timing event");
  STRATA_CUDA_CHECK(cudaEventCreate(&b), "creating a timing event");
  fn();
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a, nullptr);
    fn();
    cudaEventRecord(b, nullptr);
    STRATA_CUDA_CHECK(cudaEventSynchronize(b), "timing a kernel");
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

std::vector<CudaOptimRow> run_cuda_optim_rows(int64_t params, int iters) {
  int devices = 0;
  STRATA_CHECK(cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0,
               "bench optim --cuda needs a CUDA device; none is usable here");
  STRATA_CUDA_CHECK(cudaSetDevice(0), "selecting CUDA device 0");
  const size_t n = static_cast<size_t>(params);
  std::vector<CudaOptimRow> rows;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const bool copy = dt != DType::kFloat32;
    DeviceBuffer master(n * 4), m(n * 4), v(n * 4), grad(n * dtype_size(dt)), out(copy ? n * 2 : 0);
    // Small finite gradients: 0x3c3c.. is ~0.0115 in bf16 and ~1e-2 in fp32's upper half.
    STRATA_CUDA_CHECK(cudaMemset(grad.p, 0x3c, n * dtype_size(dt)), "filling the gradients");
    kernels::cuda::DeviceSpans s;
    s.n = params;
    s.master = static_cast<float*>(master.p);
    s.grad = grad.p;
    s.exp_avg = static_cast<float*>(m.p);
    s.exp_avg_sq = static_cast<float*>(v.p);
    s.param_copy = copy ? out.p : nullptr;
    for (const char* name : {"adamw", "lion", "sgd"}) {
      const std::string opt = name;
      const int states = opt == "adamw" ? 2 : 1;
      // Read grad, master and the states; write master, the states and the copy.
      const double bytes = static_cast<double>(n) * (dtype_size(dt) + 8 + 8 * states + (copy ? 2 : 0));
      const double kernel_ms = median_ms(iters, [&] {
        if (opt == "adamw") {
          kernels::AdamParams p;
          p.weight_decay = 0.01f;
          kernels::cuda::multi_tensor_adam(p, dt, copy ? dt : DType::kFloat32, &s, 1, nullptr, nullptr);
        } else if (opt == "lion") {
          kernels::cuda::lion_step(kernels::LionParams{}, dt, copy ? dt : DType::kFloat32, s, nullptr);
        } else {
          kernels::SgdParams p;
          p.step = 2;
          kernels::cuda::sgd_step(p, dt, copy ? dt : DType::kFloat32, s, nullptr);
        }
      });
      // The ceiling: a copy that reads and writes as many bytes in total.
      const size_t half = static_cast<size_t>(bytes / 2);
      DeviceBuffer from(half), to(half);
      const double probe_ms = median_ms(iters, [&] {
        STRATA_CUDA_CHECK(cudaMemcpyAsync(to.p, from.p, half, cudaMemcpyDeviceToDevice, nullptr), "the probe copy");
      });
      CudaOptimRow r;
      r.optimizer = opt;
      r.grad = dtype_name(dt);
      r.param = copy ? dtype_name(dt) : "fp32";
      r.params_per_s = static_cast<double>(params) / (kernel_ms / 1e3);
      r.gbps = bytes / (kernel_ms / 1e3) / 1e9;
      r.probe_gbps = 2.0 * static_cast<double>(half) / (probe_ms / 1e3) / 1e9;
      r.ratio = probe_ms / kernel_ms;
      rows.push_back(r);
    }
  }
  return rows;
}

}  // namespace strata::tools
