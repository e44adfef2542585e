// Run by the tests through `strata run -n N`: every collective of the Gloo
// communicator checked against a reference computed locally (each rank can
// compute every rank's data), for sizes including 0 and sizes the world size
// does not divide. Failure modes for the launcher and timeout tests:
//   comm_check                      check everything; prints "rank R: N checks passed"
//   comm_check --die-at-rank R      rank R exits with status 3 after the first collective
//   comm_check --skip-at-rank R     rank R never issues the all_reduce (and sleeps); the
//                                   others' all_reduce times out (--timeout-ms, default 2000)
//   comm_check --mesh DP,PP,TP,SP   builds the device mesh and checks a sum over each axis group
#include <torch/torch.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "strata/core/error.h"
#include "strata/parallel/device_mesh.h"
#include "strata/parallel/tensor_collectives.h"

using strata::DType;
using strata::parallel::ReduceOp;

namespace {

// Rank r's element i: small multiples of 1/4, so sums are exact in fp32 and fp16.
float value(int r, size_t i) { return static_cast<float>((r * 131 + static_cast<int>(i % 100000) * 7) % 97) * 0.25f - 3.0f; }

uint16_t to_half(float f) {  // exact for the small values above
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  const uint32_t mant = (x >> 13) & 0x3ff;
  if ((x & 0x7fffffff) == 0) return static_cast<uint16_t>(sign);
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | mant);
}
float from_half(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0 && mant == 0) {
    float f;
    std::memcpy(&f, &sign, 4);
    return f;
  }
  const uint32_t x = sign | (static_cast<uint32_t>(exp - 15 + 127) << 23) | (mant << 13);
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

int checks = 0;
void expect(bool ok, const std::string& what) {
  if (!ok) STRATA_FAIL("mismatch: ", what);
  checks += 1;
}

}  // namespace

int main(int argc, char** argv) {
  int die_at = -1, skip_at = -1, timeout_ms = 20000;
  std::array<int, 4> mesh{0, 0, 0, 0};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--die-at-rank") die_at = std::atoi(argv[i + 1]);
    if (a == "--skip-at-rank") skip_at = std::atoi(argv[i + 1]);
    if (a == "--timeout-ms") timeout_ms = std::atoi(argv[i + 1]);
    if (a == "--mesh") std::sscanf(argv[i + 1], "%d,%d,%d,%d", &mesh[0], &mesh[1], &mesh[2], &mesh[3]);
  }
  if (skip_at >= 0 && timeout_ms == 20000) timeout_ms = 2000;
  try {
    const auto rv = strata::parallel::Rendezvous::from_env();
    strata::parallel::CommunicatorOptions co;
    co.timeout = std::chrono::milliseconds(timeout_ms);
    auto comm = strata::parallel::make_gloo_communicator(rv, co);
    const int rank = comm->rank(), world = comm->world_size();
    comm->barrier()->wait();
    if (rank == die_at) {
      std::printf("rank %d: exiting with status 3 on purpose\n", rank);
      std::fflush(stdout);
      std::_Exit(3);
    }
    if (mesh[0] > 0) {
      // Every axis group sums the world ranks of its members: the expected sum
      // comes from the mesh's own rank arithmetic, checked here independently.
      auto m = strata::parallel::DeviceMesh::create(*comm, mesh);
      for (int a = 0; a < 4; ++a) {
        auto& g = *m.group(static_cast<strata::parallel::DeviceMesh::Axis>(a));
        expect(g.world_size() == mesh[a] && g.rank() == m.coord(static_cast<strata::parallel::DeviceMesh::Axis>(a)), "mesh group size and rank");
        float v = static_cast<float>(rank);
        g.all_reduce(&v, 1, DType::kFloat32)->wait();
        // Members differ from this rank only in coordinate a: stride = product of the faster dims.
        int stride = 1;
        for (int b = a + 1; b < 4; ++b) stride *= mesh[b];
        float want = 0;
        for (int i = 0; i < mesh[a]; ++i) want += static_cast<float>(rank + (i - m.coords()[a]) * stride);
        expect(v == want, "mesh axis " + std::to_string(a) + " sum");
      }
      {
        // The replica group: every rank that differs from this one only in dp and sp.
        auto& g = *m.replicas();
        expect(g.world_size() == mesh[0] * mesh[3], "replica group size");
        float v = static_cast<float>(rank);
        g.all_reduce(&v, 1, DType::kFloat32)->wait();
        const int dp_stride = mesh[1] * mesh[2] * mesh[3];
        float want = 0;
        for (int d = 0; d < mesh[0]; ++d) {
          for (int q = 0; q < mesh[3]; ++q) {
            want += static_cast<float>(rank + (d - m.coords()[0]) * dp_stride + (q - m.coords()[3]));
          }
        }
        expect(v == want, "replica group sum");
      }
      bool refused = false;
      try {
        strata::parallel::DeviceMesh::create(*comm, {world, 2, 1, 1});
      } catch (const strata::Error&) {
        refused = true;
      }
      expect(refused, "a mesh of the wrong size is refused");
      std::printf("rank %d: mesh %d x %d x %d x %d at (%d, %d, %d, %d): %d checks passed\n", rank, mesh[0], mesh[1],
                  mesh[2], mesh[3], m.coords()[0], m.coords()[1], m.coords()[2], m.coords()[3], checks);
      return 0;
    }
    if (skip_at >= 0) {
      if (rank == skip_at) {
        std::this_thread::sleep_for(std::chrono::milliseconds(3 * timeout_ms));
        return 0;
      }
      std::vector<float> v(16, 1.0f);
      comm->all_reduce(v.data(), v.size(), DType::kFloat32)->wait();  // never completes: a peer is missing
      std::printf("rank %d: the all_reduce completed without its peer\n", rank);
      return 0;
    }
    for (const size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{4099}}) {
      const std::string at = " at size " + std::to_string(n);
      // all_reduce: sum, max, min in fp32; sum in fp16; issued together, waited after.
      std::vector<float> s(n), mx(n), mn(n);
      std::vector<uint16_t> h(n);
      for (size_t i = 0; i < n; ++i) s[i] = mx[i] = mn[i] = value(rank, i), h[i] = to_half(value(rank, i));
      auto w1 = comm->all_reduce(s.data(), n, DType::kFloat32, ReduceOp::kSum);
      auto w2 = comm->all_reduce(mx.data(), n, DType::kFloat32, ReduceOp::kMax);
      auto w3 = comm->all_reduce(mn.data(), n, DType::kFloat32, ReduceOp::kMin);
      auto w4 = comm->all_reduce(h.data(), n, DType::kFloat16, ReduceOp::kSum);
      w1->wait(), w2->wait(), w3->wait(), w4->wait();
      for (size_t i = 0; i < n; ++i) {
        float sum = 0, hi = -1e30f, lo = 1e30f;
        for (int r = 0; r < world; ++r) sum += value(r, i), hi = std::max(hi, value(r, i)), lo = std::min(lo, value(r, i));
        expect(s[i] == sum && mx[i] == hi && mn[i] == lo, "all_reduce fp32" + at);
        expect(from_half(h[i]) == sum, "all_reduce fp16" + at);
      }
      // reduce_scatter: block b of the sum lands on rank b.
      std::vector<float> in(n * world), out(n, -1.0f);
      for (size_t i = 0; i < in.size(); ++i) in[i] = value(rank, i);
      comm->reduce_scatter(in.data(), out.data(), n, DType::kFloat32)->wait();
      for (size_t i = 0; i < n; ++i) {
        float sum = 0;
        for (int r = 0; r < world; ++r) sum += value(r, rank * n + i);
        expect(out[i] == sum, "reduce_scatter" + at);
      }
      // bf16 (Note [bf16 over Gloo]): integers below 256, exact in bf16 and in every partial sum.
      const auto whole = [](int r, size_t i) { return static_cast<float>((r * 131 + static_cast<int>(i % 1000) * 7) % 97 - 48); };
      const auto bf16 = [](float f) {  // exact for the integers above
        uint32_t x;
        std::memcpy(&x, &f, 4);
        return static_cast<uint16_t>(x >> 16);
      };
      const auto from_bf16 = [](uint16_t h) {
        const uint32_t x = static_cast<uint32_t>(h) << 16;
        float f;
        std::memcpy(&f, &x, 4);
        return f;
      };
      std::vector<uint16_t> bs(n), bm(n), bin(n * world), bout(n, 0xffff);
      for (size_t i = 0; i < n; ++i) bs[i] = bm[i] = bf16(whole(rank, i));
      for (size_t i = 0; i < bin.size(); ++i) bin[i] = bf16(whole(rank, i));
      auto b1 = comm->all_reduce(bs.data(), n, DType::kBFloat16, ReduceOp::kSum);
      auto b2 = comm->all_reduce(bm.data(), n, DType::kBFloat16, ReduceOp::kMax);
      auto b3 = comm->reduce_scatter(bin.data(), bout.data(), n, DType::kBFloat16);
      b1->wait(), b2->wait(), b3->wait();
      for (size_t i = 0; i < n; ++i) {
        float sum = 0, hi = -1e30f, block = 0;
        for (int r = 0; r < world; ++r) sum += whole(r, i), hi = std::max(hi, whole(r, i)), block += whole(r, rank * n + i);
        expect(from_bf16(bs[i]) == sum, "all_reduce bf16 sum" + at);
        expect(from_bf16(bm[i]) == hi, "all_reduce bf16 max" + at);
        expect(from_bf16(bout[i]) == block, "reduce_scatter bf16" + at);
      }
      // all_gather, broadcast, all_to_all.
      std::vector<float> mine(n), all(n * world, -1.0f);
      for (size_t i = 0; i < n; ++i) mine[i] = value(rank, i);
      comm->all_gather(mine.data(), all.data(), n, DType::kFloat32)->wait();
      for (int b = 0; b < world; ++b) {
        for (size_t i = 0; i < n; ++i) expect(all[b * n + i] == value(b, i), "all_gather" + at);
      }
      const int root = world - 1;
      std::vector<float> bc = mine;
      comm->broadcast(bc.data(), n, DType::kFloat32, root)->wait();
      for (size_t i = 0; i < n; ++i) expect(bc[i] == value(root, i), "broadcast" + at);
      std::vector<float> a2a(n * world, -1.0f);
      comm->all_to_all(in.data(), a2a.data(), n, DType::kFloat32)->wait();
      for (int b = 0; b < world; ++b) {
        for (size_t i = 0; i < n; ++i) expect(a2a[b * n + i] == value(b, rank * n + i), "all_to_all" + at);
      }
      // send/recv with the partner rank (rank ^ 1); the lower one sends first.
      const int partner = rank ^ 1;
      if (partner < world && n > 0) {
        std::vector<float> got(n, -1.0f);
        if (rank < partner) {
          comm->send(mine.data(), n * 4, partner, 7)->wait();
          comm->recv(got.data(), n * 4, partner, 8)->wait();
        } else {
          comm->recv(got.data(), n * 4, partner, 7)->wait();
          comm->send(mine.data(), n * 4, partner, 8)->wait();
        }
        for (size_t i = 0; i < n; ++i) expect(got[i] == value(partner, i), "send/recv" + at);
      }
      comm->barrier()->wait();
    }
    // The tensor forms, against torch's own arithmetic.
    {
      const torch::Tensor mine = torch::arange(6, torch::kFloat32).reshape({2, 3}) + rank;
      torch::Tensor sum = mine.clone();
      strata::parallel::all_reduce(*comm, sum)->wait();
      torch::Tensor expect_sum = torch::zeros({2, 3});
      for (int r = 0; r < world; ++r) expect_sum += torch::arange(6, torch::kFloat32).reshape({2, 3}) + r;
      expect(torch::equal(sum, expect_sum), "tensor all_reduce");
      torch::Tensor gathered = torch::empty({world, 2, 3});
      strata::parallel::all_gather(*comm, mine, gathered)->wait();
      for (int r = 0; r < world; ++r) {
        expect(torch::equal(gathered[r], torch::arange(6, torch::kFloat32).reshape({2, 3}) + r), "tensor all_gather");
      }
      torch::Tensor block = torch::empty({2, 3});
      strata::parallel::reduce_scatter(*comm, gathered, block)->wait();
      expect(torch::equal(block, (torch::arange(6, torch::kFloat32).reshape({2, 3}) + rank) * world),
             "tensor reduce_scatter");
      torch::Tensor wrong = torch::empty({world + 1, 2, 3});
      bool refused = false;
      try {
        strata::parallel::all_gather(*comm, mine, wrong);
      } catch (const strata::Error&) {
        refused = true;
      }
      expect(refused, "a wrongly shaped tensor is refused");
    }
    std::printf("rank %d: %d checks passed\n", rank, checks);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_check: %s\n", e.what());
    return 1;
  }
  return 0;
}
