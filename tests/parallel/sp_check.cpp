// Run by the tests through `strata run -n N`: Ulysses sequence-parallel
// attention and the paper's ring self-attention
// (parallel/include/strata/parallel/sequence_parallel.h) against
// single-process attention on the whole sequence, on every rank, causal and
// not: the output and the gradients of q, k, v and of a replicated
// projection (summed over the group) within 1e-5; a head count or sequence
// length the group does not divide is refused before any collective.
// Ring attention (online softmax) in the contiguous and the zigzag layout too.
// Prints "rank R: Ulysses sequence parallel (N ranks) matches single-process attention" or fails.
#include <torch/torch.h>

#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <limits>

#include "strata/core/error.h"
#include "strata/parallel/communicator.h"
#include "strata/parallel/sequence_parallel.h"
#include "strata/parallel/tensor_collectives.h"
#include "rank_check.h"

using namespace strata::parallel;

namespace {

using rank_check::expect_close;
using rank_check::shared;
using rank_check::worst;

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal) {
  torch::Tensor s = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  if (causal) s = s.masked_fill(torch::ones({q.size(2), q.size(2)}, torch::kBool).triu(1), -std::numeric_limits<float>::infinity());
  return torch::matmul(torch::softmax(s, -1), v);
}

void expect_refused(const std::function<void()>& fn, const std::string& words) {
  const std::string got = rank_check::error_of(fn);
  STRATA_CHECK(got.find(words) != std::string::npos, "expected an error saying \"", words, "\", got: ", got);
}

using Attention = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, Communicator&,
                                    bool);
using Split = torch::Tensor (*)(const torch::Tensor&, int64_t, Communicator&);

torch::Tensor ring_contiguous(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, Communicator& g,
                              bool causal) {
  return ring_attention(q, k, v, g, causal, SequenceLayout::kContiguous);
}
torch::Tensor ring_zigzag(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, Communicator& g,
                          bool causal) {
  return ring_attention(q, k, v, g, causal, SequenceLayout::kZigzag);
}

void check(Communicator& comm, bool causal, Attention attend, int64_t h, const std::string& name,
           Split split = &split_sequence) {
  const int64_t n = comm.world_size(), b = 2, s = 8 * n, d = 8, e = 16;
  torch::manual_seed(comm.rank() + 3);
  const torch::Tensor x = shared(comm, torch::randn({b, s, e}));
  const torch::Tensor wq = shared(comm, torch::randn({h * d, e}) * 0.2), wkv = shared(comm, torch::randn({2 * h * d, e}) * 0.2);
  const torch::Tensor w = shared(comm, torch::randn({b, h, s, d}));
  // Single process: projections, attention, a weighted sum as the loss.
  const auto heads = [&](const torch::Tensor& y) { return y.view({b, y.size(1), h, d}).transpose(1, 2); };
  torch::Tensor pq = wq.clone().requires_grad_(), pkv = wkv.clone().requires_grad_();
  torch::Tensor q = heads(torch::matmul(x, pq.t())).detach().requires_grad_();
  auto kv = torch::matmul(x, pkv.t()).chunk(2, -1);
  torch::Tensor k = heads(kv[0]), v = heads(kv[1]);
  k.retain_grad();
  v.retain_grad();
  torch::Tensor out = attention(q, k, v, causal);
  (out * w).sum().backward();
  // This rank's positions: projections replicated, sequence split.
  const torch::Tensor xl = split(x, 1, comm);
  torch::Tensor lq_w = wq.clone().requires_grad_(), lkv_w = wkv.clone().requires_grad_();
  torch::Tensor lq = heads(torch::matmul(xl, lq_w.t())).detach().requires_grad_();
  auto lkv = torch::matmul(xl, lkv_w.t()).chunk(2, -1);
  torch::Tensor lk = heads(lkv[0]), lv = heads(lkv[1]);
  lk.retain_grad();
  lv.retain_grad();
  torch::Tensor lout = attend(lq, lk, lv, comm, causal);
  const std::string mode = " of " + name + (causal ? " (causal)" : "");
  expect_close(lout, split(out, 2, comm), "output" + mode);
  (lout * split(w, 2, comm)).sum().backward();
  expect_close(lq.grad(), split(q.grad(), 2, comm), "q gradient" + mode);
  expect_close(lk.grad(), split(k.grad(), 2, comm), "k gradient" + mode);
  expect_close(lv.grad(), split(v.grad(), 2, comm), "v gradient" + mode);
  // A replicated projection's gradient is the sum of the ranks' parts.
  torch::Tensor g = lkv_w.grad().clone();
  all_reduce(comm, g)->wait();
  expect_close(g, pkv.grad(), "k/v projection gradient (summed over the group)" + mode);
}

}  // namespace

int main(int argc, char** argv) {
  // --stuck: rank 1 stops answering before the ring attention checks (as a
  // dead or hung rank would); rank 0 must fail with an error within the
  // timeout (STRATA_COMM_TIMEOUT), not hang. (A rank that exits is also
  // caught by the launcher, which stops the others at once.)
  const bool stuck = argc > 1 && std::string(argv[1]) == "--stuck";
  try {
    // make_gloo_communicator takes the timeout from STRATA_COMM_TIMEOUT.
    std::shared_ptr<Communicator> comm = make_gloo_communicator(Rendezvous::from_env());
    const int64_t n = comm->world_size();
    // Sizes the group does not divide: refused before any collective.
    expect_refused([&] { split_sequence(torch::zeros({2, 4 * n + 1}), 1, *comm); }, "does not split evenly");
    const torch::Tensor odd = torch::zeros({1, 2 * n + 1, 4, 8});
    expect_refused([&] { ulysses_attention(odd, odd, odd, *comm, false); }, "attention heads evenly");
    check(*comm, false, &ulysses_attention, 4, "Ulysses");
    check(*comm, true, &ulysses_attention, 4, "Ulysses");
    std::printf("rank %d: Ulysses sequence parallel (%d ranks) matches single-process attention (worst relative "
                "difference %.2e)\n", comm->rank(), comm->world_size(), worst());
    worst() = 0;
    check(*comm, false, &ring_self_attention, 3, "ring self-attention");  // any head count
    check(*comm, true, &ring_self_attention, 3, "ring self-attention");
    std::printf("rank %d: ring self-attention (%d ranks) matches single-process attention (worst relative "
                "difference %.2e)\n", comm->rank(), comm->world_size(), worst());
    worst() = 0;
    if (stuck && comm->rank() == 1) {
      rank_check::hang_until_stopped();
    }
    expect_refused([&] { split_sequence_zigzag(torch::zeros({2, 2 * n + 2}), 1, *comm); }, "zigzag layout");
    for (bool causal : {false, true}) {
      check(*comm, causal, &ring_contiguous, 3, "ring attention");
      check(*comm, causal, &ring_zigzag, 3, "ring attention (zigzag)", &split_sequence_zigzag);
    }
    std::printf("rank %d: ring attention (%d ranks, contiguous and zigzag) matches single-process attention (worst "
                "relative difference %.2e)\n", comm->rank(), comm->world_size(), worst());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sp_check: %s\n", e.what());
    return 1;
  }
  return 0;
}
