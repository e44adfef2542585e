// Run by the tests through `strata run -n N`: every NCCL collective on device
// buffers (and on host buffers, staged) against the same collective by Gloo
// on host copies of the same random data. Exits 77 (skipped) without a GPU for every rank.
#include <cuda_runtime.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "strata/core/error.h"
#include "strata/parallel/communicator.h"

using namespace strata;
using namespace strata::parallel;

namespace {

struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) : bytes(n * sizeof(float)) {
    STRATA_CHECK(cudaMalloc(&ptr, bytes > 0 ? bytes : 1) == cudaSuccess, "cudaMalloc of ", bytes, " bytes");
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  void put(const std::vector<float>& v) {
    STRATA_CHECK(cudaMemcpy(ptr, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess, "copy");
  }
  std::vector<float> get(size_t n) const {
    std::vector<float> v(n);
    STRATA_CHECK(cudaMemcpy(v.data(), ptr, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess, "copy");
    return v;
  }
  void* ptr = nullptr;
  size_t bytes;
};

void expect_equal(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  STRATA_CHECK(a.size() == b.size(), what, ": sizes differ");
  for (size_t i = 0; i < a.size(); ++i) {
    // Sums of a few fp32 values in another order: a relative tolerance.
    STRATA_CHECK(std::abs(a[i] - b[i]) <= 1e-5f * (1.0f + std::abs(b[i])), what, ": element ", i, " is ", a[i],
                 " with NCCL and ", b[i], " with Gloo");
  }
}

}  // namespace

int main() {
  try {
    const Rendezvous rv = Rendezvous::from_env();
    int devices = 0;
    if (!nccl_available() || cudaGetDeviceCount(&devices) != cudaSuccess || devices < rv.local_world_size) {
      std::printf("skipped: %d GPUs for %d local ranks\n", devices, rv.local_world_size);
      return 77;
    }
    std::shared_ptr<Communicator> gloo = make_gloo_communicator(rv);
    std::unique_ptr<Communicator> nccl = make_nccl_communicator(gloo, rv.local_rank);
    const int n = gloo->world_size(), rank = gloo->rank();
    STRATA_CHECK(nccl->backend() == "nccl" && nccl->world_size() == n && nccl->rank() == rank, "NCCL's world");
    std::mt19937 gen(17 + rank);
    std::normal_distribution<float> dist;
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{4099}}) {
      std::vector<float> in(count * n);
      for (float& x : in) x = dist(gen);
      DeviceBuffer din(in.size()), dout(in.size());
      // all_reduce
      std::vector<float> ref = in;
      gloo->all_reduce(ref.data(), ref.size(), DType::kFloat32)->wait();
      din.put(in);
      nccl->all_reduce(din.ptr, in.size(), DType::kFloat32)->wait();
      expect_equal(din.get(in.size()), ref, "all_reduce");
      // reduce_scatter
      std::vector<float> rs(count);
      gloo->reduce_scatter(in.data(), rs.data(), count, DType::kFloat32)->wait();
      din.put(in);
      nccl->reduce_scatter(din.ptr, dout.ptr, count, DType::kFloat32)->wait();
      expect_equal(dout.get(count), rs, "reduce_scatter");
      // all_gather, also in place
      std::vector<float> ag(count * n);
      gloo->all_gather(in.data(), ag.data(), count, DType::kFloat32)->wait();
      din.put(in);
      nccl->all_gather(din.ptr, dout.ptr, count, DType::kFloat32)->wait();
      expect_equal(dout.get(count * n), ag, "all_gather");
      std::vector<float> staged(count * n, 0.0f);
      std::copy(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(count), staged.begin() + rank * count);
      dout.put(staged);
      nccl->all_gather(static_cast<float*>(dout.ptr) + rank * count, dout.ptr, count, DType::kFloat32)->wait();
      expect_equal(dout.get(count * n), ag, "all_gather in place");
      // broadcast from the last rank
      std::vector<float> bc = in;
      gloo->broadcast(bc.data(), bc.size(), DType::kFloat32, n - 1)->wait();
      din.put(in);
      nccl->broadcast(din.ptr, in.size(), DType::kFloat32, n - 1)->wait();
      expect_equal(din.get(in.size()), bc, "broadcast");
      // all_to_all
      std::vector<float> a2a(count * n);
      gloo->all_to_all(in.data(), a2a.data(), count, DType::kFloat32)->wait();
      din.put(in);
      nccl->all_to_all(din.ptr, dout.ptr, count, DType::kFloat32)->wait();
      expect_equal(dout.get(count * n), a2a, "all_to_all");
      // Host buffers, staged through device memory (Note [Host buffers on NCCL]): the engine's host chunks.
      std::vector<float> host = in;
      nccl->all_reduce(host.data(), host.size(), DType::kFloat32)->wait();
      expect_equal(host, ref, "all_reduce of a host buffer");
      std::vector<float> host_rs(count, -1.0f);
      nccl->reduce_scatter(in.data(), host_rs.data(), count, DType::kFloat32)->wait();
      expect_equal(host_rs, rs, "reduce_scatter between host buffers");
      nccl->barrier()->wait();
    }
    std::printf("rank %d: NCCL collectives match Gloo on %d ranks\n", rank, n);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nccl_check: %s\n", e.what());
    return 1;
  }
  return 0;
}
