// Run by the tests through `strata run -n N`: 1D tensor-parallel layers
// (parallel/include/strata/parallel/tensor_parallel.h) against the same
// single-process LibTorch layers, on every rank. Full tensors are built on
// rank 0 and broadcast; each rank takes its slice.
//   - column-parallel linear (output gathered), row-parallel linear (input
//     sliced here), and the pair as an MLP: forward output and every gradient
//     (input, weights, biases) within 1e-5;
//   - vocab-parallel embedding and a column-parallel head with the
//     vocab-parallel cross-entropy: loss and gradients;
//   - a layer size the group does not divide: refused at construction;
//   - a model of them trained 10 steps by strata (attach, three chunk pages of
//     device per rank, gradient-norm clipping active) with the same gradient
//     norms, losses and weights as one process with clip_grad_norm_ and
//     torch::optim::AdamW.
// Prints "rank R: tensor parallel (1D, P ranks) matches single-process LibTorch" or fails.
#include <torch/torch.h>

#include <cstdio>
#include <functional>

#include "strata/core/error.h"
#include "strata/parallel/device_mesh.h"
#include "strata/parallel/engine.h"
#include "strata/parallel/parallelize.h"
#include "strata/parallel/tensor_collectives.h"
#include "strata/parallel/tensor_parallel.h"
#include "rank_check.h"

using namespace strata::parallel;

namespace {

using rank_check::DeviceBudget;
using rank_check::expect_close;
using rank_check::LossFn;
using rank_check::train_against;
using rank_check::share_module;
using rank_check::shared;
using rank_check::worst;

void copy_module(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < to.parameters().size(); ++i) to.parameters()[i].copy_(from.parameters()[i]);
}

int64_t count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

torch::Tensor rows(const torch::Tensor& t, Communicator& comm) {
  const auto [b, e] = slice_of(t.size(0), comm, "rows");
  return t.narrow(0, b, e - b);
}
torch::Tensor cols(const torch::Tensor& t, Communicator& comm) {
  const auto [b, e] = slice_of(t.size(1), comm, "columns");
  return t.narrow(1, b, e - b);
}

void layers(Communicator& comm) {
  // A size the group does not divide: a clear error at construction, before any collective.
  bool refused = false;
  try {
    ColumnParallelLinear(8, 9, comm);
  } catch (const strata::Error& e) {
    refused = std::string(e.what()).find("splits the output features (9) evenly") != std::string::npos;
  }
  STRATA_CHECK(refused, "a column-parallel layer of 9 outputs over ", comm.world_size(), " ranks was not refused");
  torch::manual_seed(comm.rank() + 1);  // replicas differ until shared
  // Column-parallel, output gathered.
  torch::nn::Linear full(8, 12);
  share_module(comm, *full);
  ColumnParallelLinear col(full, comm, /*gather_output=*/true);
  const torch::Tensor x = shared(comm, torch::randn({6, 8})), w = shared(comm, torch::randn({6, 12}));
  torch::Tensor xr = x.clone().requires_grad_(), xt = x.clone().requires_grad_();
  torch::Tensor yr = full->forward(xr), yt = col->forward(xt);
  expect_close(yt, yr, "column-parallel output");
  (yr * w).sum().backward();
  (yt * w).sum().backward();
  expect_close(xt.grad(), xr.grad(), "column-parallel input gradient");
  expect_close(col->weight.grad(), rows(full->weight.grad(), comm), "column-parallel weight gradient");
  expect_close(col->bias.grad(), rows(full->bias.grad().unsqueeze(1), comm).squeeze(1), "column-parallel bias gradient");

  // Row-parallel, input sliced here.
  torch::nn::Linear full_row(12, 8);
  share_module(comm, *full_row);
  RowParallelLinear row(full_row, comm, /*input_is_parallel=*/false);
  const torch::Tensor x2 = shared(comm, torch::randn({6, 12})), w2 = shared(comm, torch::randn({6, 8}));
  torch::Tensor ar = x2.clone().requires_grad_(), at = x2.clone().requires_grad_();
  torch::Tensor zr = full_row->forward(ar), zt = row->forward(at);
  expect_close(zt, zr, "row-parallel output");
  (zr * w2).sum().backward();
  (zt * w2).sum().backward();
  expect_close(at.grad(), ar.grad(), "row-parallel input gradient");
  expect_close(row->weight.grad(), cols(full_row->weight.grad(), comm), "row-parallel weight gradient");
  expect_close(row->bias.grad(), full_row->bias.grad(), "row-parallel bias gradient");

  // The Megatron MLP: column (sliced output) -> GELU -> row (sliced input).
  torch::nn::Linear up(8, 16), down(16, 8);
  share_module(comm, *up);
  share_module(comm, *down);
  ColumnParallelLinear tup(up, comm);
  RowParallelLinear tdown(down, comm);
  torch::Tensor mr = x.clone().requires_grad_(), mt = x.clone().requires_grad_();
  torch::Tensor outr = down->forward(torch::gelu(up->forward(mr)));
  torch::Tensor outt = tdown->forward(torch::gelu(tup->forward(mt)));
  expect_close(outt, outr, "MLP output");
  outr.pow(2).sum().backward();
  outt.pow(2).sum().backward();
  expect_close(mt.grad(), mr.grad(), "MLP input gradient");
  expect_close(tup->weight.grad(), rows(up->weight.grad(), comm), "MLP up weight gradient");
  expect_close(tdown->weight.grad(), cols(down->weight.grad(), comm), "MLP down weight gradient");

  // Vocab-parallel embedding, a column-parallel head, the vocab-parallel cross-entropy.
  torch::nn::Embedding emb(20, 8);
  torch::nn::Linear head(torch::nn::LinearOptions(8, 20).bias(false));
  share_module(comm, *emb);
  share_module(comm, *head);
  VocabParallelEmbedding temb(emb, comm);
  ColumnParallelLinear thead(head, comm);
  const torch::Tensor ids = shared(comm, torch::randint(0, 20, {10}).to(torch::kFloat32)).to(torch::kLong);
  const torch::Tensor target = shared(comm, torch::randint(0, 20, {10}).to(torch::kFloat32)).to(torch::kLong);
  torch::Tensor lr = torch::nn::functional::cross_entropy(head->forward(torch::tanh(emb->forward(ids))), target);
  torch::Tensor lt = vocab_parallel_cross_entropy(thead->forward(torch::tanh(temb->forward(ids))), target, comm);
  expect_close(lt, lr, "vocab-parallel cross-entropy");
  lr.backward();
  lt.backward();
  expect_close(temb->weight.grad(), rows(emb->weight.grad(), comm), "vocab-parallel embedding gradient");
  expect_close(thead->weight.grad(), rows(head->weight.grad(), comm), "vocab-parallel head gradient");
}

struct Full : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr}, head{nullptr};
  Full() {
    emb = register_module("emb", torch::nn::Embedding(32, 16));
    up = register_module("up", torch::nn::Linear(16, 64));
    down = register_module("down", torch::nn::Linear(64, 16));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(16, 32).bias(false)));
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& target) {  // token ids of any shape
    torch::Tensor x = emb->forward(ids.reshape(-1));
    x = x + down->forward(torch::gelu(up->forward(x)));
    return torch::nn::functional::cross_entropy(head->forward(x), target.reshape(-1));
  }
};

struct Tp : torch::nn::Module {
  Communicator& comm;
  VocabParallelEmbedding emb{nullptr};
  ColumnParallelLinear up{nullptr}, head{nullptr};
  RowParallelLinear down{nullptr};
  Tp(Full& f, Communicator& c) : comm(c) {
    emb = register_module("emb", VocabParallelEmbedding(f.emb, c));
    up = register_module("up", ColumnParallelLinear(f.up, c));
    down = register_module("down", RowParallelLinear(f.down, c));
    head = register_module("head", ColumnParallelLinear(f.head, c));
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& target) {  // token ids of any shape
    torch::Tensor x = emb->forward(ids.reshape(-1));
    x = x + down->forward(torch::gelu(up->forward(x)));
    return vocab_parallel_cross_entropy(head->forward(x), target.reshape(-1), comm);
  }
};

// Full's loss, for train_against.
LossFn loss_of(Full& m) {
  return [&m](const torch::Tensor& i, const torch::Tensor& t) { return m.loss(i, t); };
}

void training(Communicator& comm, bool resident) {
  torch::manual_seed(comm.rank() + 7);
  Full reference;
  share_module(comm, reference);
  Tp model(reference, comm);
  train_against(comm, reference, loss_of(reference), model,
                [&](const torch::Tensor& i, const torch::Tensor& t) { return model.loss(i, t); }, 32, 6,
                resident ? DeviceBudget::kResident : DeviceBudget::kPages);
  expect_close(model.emb->weight, rows(reference.emb->weight, comm), "trained embedding slice");
  expect_close(model.up->weight, rows(reference.up->weight, comm), "trained up slice");
  expect_close(model.down->weight, cols(reference.down->weight, comm), "trained down slice");
  expect_close(model.down->bias, reference.down->bias, "trained replicated bias");
  expect_close(model.head->weight, rows(reference.head->weight, comm), "trained head slice");
}

// The Tp model's split as a plan, on an unmodified Full: the head gathers its
// logits, so Full's own loss (plain cross-entropy) runs unchanged.
ParallelPlan full_plan() {
  return {{"emb", ParallelStyle::vocab_embedding()},
          {"up", ParallelStyle::columnwise()},
          {"down", ParallelStyle::rowwise()},
          {"head", ParallelStyle::columnwise(1, /*gather_output=*/true)}};
}

std::vector<std::vector<int64_t>> shapes(torch::nn::Module& m) {
  std::vector<std::vector<int64_t>> out;
  for (const auto& p : m.parameters()) out.push_back(p.sizes().vec());
  return out;
}

// A bad plan: refused with `message`, before any change or collective.
void expect_refused(Communicator& comm, const ParallelPlan& plan, const std::string& message,
                    const std::function<void(torch::nn::Module&)>& extend = nullptr) {
  Full m;
  if (extend) extend(m);
  const auto before = shapes(m);
  std::string got = "no error";
  try {
    parallelize(m, comm, plan);
  } catch (const strata::Error& e) {
    got = e.what();
  }
  STRATA_CHECK(got.find(message) != std::string::npos, "a bad plan (", plan.empty() ? "" : plan[0].first,
               ") gave \"", got, "\", not an error saying \"", message, "\"");
  STRATA_CHECK(shapes(m) == before, "a refused plan changed the module's parameters");
  for (const auto& p : m.parameters()) STRATA_CHECK(tensor_group_of(p) == nullptr, "a refused plan split a parameter");
}

// parallelize() on an unmodified module: the plan's errors, layers against
// LibTorch, and training as one process.
void plan(Communicator& comm, std::shared_ptr<Communicator> world) {
  expect_refused(comm, {{"blocks.*.up", ParallelStyle::columnwise()}}, "matches no submodule");
  expect_refused(comm, {{"emb", ParallelStyle::rowwise()}}, "the row-wise style splits a torch::nn::Linear");
  expect_refused(comm, {{"up", ParallelStyle::columnwise(3)}}, "output features are not 3 equal fused blocks");
  expect_refused(comm, {{"u*", ParallelStyle::columnwise()}, {"up", ParallelStyle::rowwise()}}, "matches two plan entries");
  expect_refused(comm, {{"up", ParallelStyle::columnwise(2, /*gather_output=*/true)}}, "fused blocks and a gathered output");
  // A size the group does not divide, after a valid entry: nothing changes.
  const int odd = comm.world_size() + 1;
  expect_refused(comm, {{"up", ParallelStyle::columnwise()}, {"odd", ParallelStyle::columnwise()}},
                 "splits the output features of odd (" + std::to_string(odd) + ") evenly",
                 [&](torch::nn::Module& m) { m.register_module("odd", torch::nn::Linear(16, odd)); });

  // Each style on a Sequential against LibTorch, with 2-D inputs (LibTorch
  // 1.13's F::linear is addmm then) and 3-D ones (matmul, then += bias): a
  // column-wise layer gathering its output (its bias whole), then one keeping
  // its slice (fused blocks) into a row-wise one, and an embedding split by dim.
  for (const int dims : {2, 3}) {
    torch::manual_seed(comm.rank() + 5);
    torch::nn::Sequential ref(torch::nn::Linear(8, 12), torch::nn::Functional(torch::tanh), torch::nn::Linear(12, 12),
                              torch::nn::GELU(), torch::nn::Linear(12, 8));
    share_module(comm, *ref);
    torch::nn::Sequential seq(torch::nn::Linear(8, 12), torch::nn::Functional(torch::tanh), torch::nn::Linear(12, 12),
                              torch::nn::GELU(), torch::nn::Linear(12, 8));
    copy_module(*ref, *seq);
    parallelize(*seq, comm, {{"0", ParallelStyle::columnwise(1, /*gather_output=*/true)},
                             {"2", ParallelStyle::columnwise()},
                             {"4", ParallelStyle::rowwise()}});
    const torch::Tensor x = shared(comm, dims == 2 ? torch::randn({6, 8}) : torch::randn({2, 3, 8}));
    torch::Tensor xr = x.clone().requires_grad_(), xt = x.clone().requires_grad_();
    torch::Tensor yr = ref->forward(xr), yt = seq->forward(xt);
    const std::string in = std::to_string(dims) + "-D";
    expect_close(yt, yr, "planned Sequential output, " + in);
    yr.pow(2).sum().backward();
    yt.pow(2).sum().backward();
    expect_close(xt.grad(), xr.grad(), "planned Sequential input gradient, " + in);
    auto lin = [](torch::nn::Sequential& s, size_t i) { return s[i]->as<torch::nn::Linear>(); };
    expect_close(lin(seq, 0)->weight.grad(), rows(lin(ref, 0)->weight.grad(), comm), "gathered column weight gradient, " + in);
    expect_close(lin(seq, 0)->bias.grad(), lin(ref, 0)->bias.grad(), "gathered column (whole) bias gradient, " + in);
    expect_close(lin(seq, 2)->weight.grad(), rows(lin(ref, 2)->weight.grad(), comm), "column weight gradient, " + in);
    expect_close(lin(seq, 2)->bias.grad(), rows(lin(ref, 2)->bias.grad().unsqueeze(1), comm).squeeze(1),
                 "column bias gradient, " + in);
    expect_close(lin(seq, 4)->weight.grad(), cols(lin(ref, 4)->weight.grad(), comm), "row weight gradient, " + in);
    expect_close(lin(seq, 4)->bias.grad(), lin(ref, 4)->bias.grad(), "row bias gradient, " + in);
  }
  {
    // Megatron's sequence parallelism: a norm on sequence shards, a column-wise
    // layer all-gathering them, a row-wise one reduce-scattering its output;
    // the shard's output and every gradient as one process's.
    torch::manual_seed(comm.rank() + 9);
    auto make = [] {
      return torch::nn::Sequential(torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})), torch::nn::Linear(8, 16),
                                   torch::nn::GELU(), torch::nn::Linear(16, 8));
    };
    torch::nn::Sequential ref = make(), seq = make();
    {
      torch::NoGradGuard no_grad;
      ref[0]->as<torch::nn::LayerNorm>()->weight.normal_(1.0, 0.3);
      ref[0]->as<torch::nn::LayerNorm>()->bias.normal_(0.0, 0.3);
    }
    share_module(comm, *ref);
    copy_module(*ref, *seq);
    parallelize(*seq, comm, {{"0", ParallelStyle::sequence_shard()},
                             {"1", ParallelStyle::columnwise().along_sequence(1)},
                             {"3", ParallelStyle::rowwise().along_sequence(1)}});
    const int64_t s_len = 2 * comm.world_size();
    const torch::Tensor x = shared(comm, torch::randn({3, s_len, 8})), w = shared(comm, torch::randn({3, s_len, 8}));
    const auto [sb, se] = slice_of(s_len, comm, "the sequence");
    auto shard = [&](const torch::Tensor& t) { return t.narrow(1, sb, se - sb).contiguous(); };
    torch::Tensor xr = x.clone().requires_grad_(), xt = shard(x).requires_grad_();
    torch::Tensor yr = ref->forward(xr), yt = seq->forward(xt);
    expect_close(yt, shard(yr), "sequence-parallel output (this rank's positions)");
    (yr * w).sum().backward();
    (yt * shard(w)).sum().backward();
    expect_close(xt.grad(), shard(xr.grad()), "sequence-parallel input gradient");
    auto ln = [](torch::nn::Sequential& m) { return m[0]->as<torch::nn::LayerNorm>(); };
    auto lin = [](torch::nn::Sequential& m, size_t i) { return m[i]->as<torch::nn::Linear>(); };
    expect_close(ln(seq)->weight.grad(), ln(ref)->weight.grad(), "sequence-parallel norm weight gradient");
    expect_close(ln(seq)->bias.grad(), ln(ref)->bias.grad(), "sequence-parallel norm bias gradient");
    expect_close(lin(seq, 1)->weight.grad(), rows(lin(ref, 1)->weight.grad(), comm), "sequence-parallel column gradient");
    expect_close(lin(seq, 3)->weight.grad(), cols(lin(ref, 3)->weight.grad(), comm), "sequence-parallel row gradient");
    expect_close(lin(seq, 3)->bias.grad(), lin(ref, 3)->bias.grad(), "sequence-parallel row bias gradient");
    STRATA_CHECK(tensor_copies_of(ln(seq)->weight) == comm.world_size(),
                 "a sequence-shard norm's weight is not recorded as held whole by every rank");
  }
  {
    // Fused blocks (a QKV projection): each rank's output is its slice of each block, in block order.
    torch::manual_seed(comm.rank() + 8);
    torch::nn::Sequential ref(torch::nn::Linear(8, 12)), seq(torch::nn::Linear(8, 12));
    share_module(comm, *ref);
    copy_module(*ref, *seq);
    parallelize(*seq, comm, {{"0", ParallelStyle::columnwise(/*fused=*/3)}});
    auto fused = [&](const torch::Tensor& t, int64_t dim) {  // this rank's part of each of the three blocks
      std::vector<torch::Tensor> parts;
      for (const torch::Tensor& block : t.chunk(3, dim)) {
        const auto [b, e] = slice_of(block.size(dim), comm, "a block");
        parts.push_back(block.narrow(dim, b, e - b));
      }
      return torch::cat(parts, dim);
    };
    const torch::Tensor x = shared(comm, torch::randn({2, 3, 8})), w = shared(comm, torch::randn({2, 3, 12}));
    torch::Tensor xr = x.clone().requires_grad_(), xt = x.clone().requires_grad_();
    torch::Tensor yr = ref->forward(xr), yt = seq->forward(xt);
    expect_close(yt, fused(yr, -1), "fused column output");
    (yr * w).sum().backward();
    (yt * fused(w, -1)).sum().backward();
    expect_close(xt.grad(), xr.grad(), "fused column input gradient");
    auto lin = [](torch::nn::Sequential& s) { return s[0]->as<torch::nn::Linear>(); };
    expect_close(lin(seq)->weight.grad(), fused(lin(ref)->weight.grad(), 0), "fused column weight gradient");
    expect_close(lin(seq)->bias.grad(), fused(lin(ref)->bias.grad(), 0), "fused column bias gradient");
  }
  {
    torch::manual_seed(comm.rank() + 6);
    torch::nn::Embedding ref(10, 8), emb(10, 8);
    share_module(comm, *ref);
    copy_module(*ref, *emb);
    torch::nn::Sequential holder;
    holder->push_back("emb", emb);
    parallelize(*holder, comm, {{"emb", ParallelStyle::columnwise(1, /*gather_output=*/true)}});
    const torch::Tensor ids = shared(comm, torch::randint(0, 10, {7}).to(torch::kFloat32)).to(torch::kLong);
    const torch::Tensor w = shared(comm, torch::randn({7, 8}));
    torch::Tensor yr = ref->forward(ids), yt = emb->forward(ids);
    expect_close(yt, yr, "embedding split by dim, output");
    (yr * w).sum().backward();
    (yt * w).sum().backward();
    expect_close(emb->weight.grad(), cols(ref->weight.grad(), comm), "embedding split by dim, gradient");
  }

  // Layers by plan against LibTorch: forward and every gradient.
  torch::manual_seed(comm.rank() + 11);
  Full reference;
  share_module(comm, reference);
  Full model;
  copy_module(reference, model);
  const ParallelizeResult split = parallelize(model, comm, full_plan());
  STRATA_CHECK(split.split.size() == 4 && split.full_params == count(reference), "parallelize split ",
               split.split.size(), " submodules of ", split.full_params, " parameters");
  const int64_t replicated = reference.down->bias.numel();
  STRATA_CHECK(split.local_params == (split.full_params - replicated) / comm.world_size() + replicated,
               "this rank holds ", split.local_params, " parameters after parallelize");
  const torch::Tensor ids = shared(comm, torch::randint(0, 32, {12}).to(torch::kFloat32)).to(torch::kLong);
  const torch::Tensor target = shared(comm, torch::randint(0, 32, {12}).to(torch::kFloat32)).to(torch::kLong);
  torch::Tensor lr = reference.loss(ids, target), lt = model.loss(ids, target);
  expect_close(lt, lr, "planned model's loss");
  lr.backward();
  lt.backward();
  expect_close(model.emb->weight.grad(), rows(reference.emb->weight.grad(), comm), "planned embedding gradient");
  expect_close(model.up->weight.grad(), rows(reference.up->weight.grad(), comm), "planned up gradient");
  expect_close(model.up->bias.grad(), rows(reference.up->bias.grad().unsqueeze(1), comm).squeeze(1), "planned up bias gradient");
  expect_close(model.down->weight.grad(), cols(reference.down->weight.grad(), comm), "planned down gradient");
  expect_close(model.down->bias.grad(), reference.down->bias.grad(), "planned down bias gradient");
  expect_close(model.head->weight.grad(), rows(reference.head->weight.grad(), comm), "planned head gradient");
  STRATA_CHECK(tensor_group_of(model.up->weight) == &comm && tensor_group_of(model.down->bias) == nullptr,
               "parallelize did not record which parameters it split");

  // Training by plan, on the tensor group alone and, with a world of 4, as tp 2 x dp 2 at ZeRO 0-2.
  auto trained = [&](Full& ref, Full& m, Communicator& g) {
    return [&] {
      expect_close(m.emb->weight, rows(ref.emb->weight, g), "trained planned embedding slice");
      expect_close(m.up->weight, rows(ref.up->weight, g), "trained planned up slice");
      expect_close(m.down->weight, cols(ref.down->weight, g), "trained planned down slice");
      expect_close(m.down->bias, ref.down->bias, "trained planned replicated bias");
      expect_close(m.head->weight, rows(ref.head->weight, g), "trained planned head slice");
    };
  };
  {
    torch::manual_seed(comm.rank() + 13);
    Full ref, m;
    share_module(comm, ref);
    copy_module(ref, m);
    parallelize(m, comm, full_plan());
    train_against(comm, ref, loss_of(ref), m, loss_of(m), 32, 6, DeviceBudget::kPages);
    trained(ref, m, comm)();
  }
  if (world->world_size() == 4) {
    DeviceMesh mesh = DeviceMesh::create(*world, {2, 1, 2, 1});
    std::shared_ptr<Communicator> dp = mesh.group(DeviceMesh::kData);
    for (int stage = 0; stage <= 2; ++stage) {
      torch::manual_seed(world->rank() + 17);
      Full ref, m;
      share_module(*world, ref);
      copy_module(ref, m);
      parallelize(m, mesh, full_plan());
      train_against(*world, ref, loss_of(ref), m, loss_of(m), 32, 6, DeviceBudget::kPages, dp, stage);
      trained(ref, m, *mesh.group(DeviceMesh::kTensor))();
    }
    std::printf("rank %d: tp 2 x dp 2 at ZeRO stages 0-2 matches single-process LibTorch\n", world->rank());
  }
}

}  // namespace

int main() {
  try {
    std::shared_ptr<Communicator> comm = make_gloo_communicator(Rendezvous::from_env());
    layers(*comm);
    training(*comm, /*resident=*/true);
    training(*comm, /*resident=*/false);
    plan(*comm, comm);
    std::printf("rank %d: tensor parallel (1D, %d ranks) matches single-process LibTorch (worst relative difference "
                "%.2e)\n", comm->rank(), comm->world_size(), worst());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp_check: %s\n", e.what());
    return 1;
  }
  return 0;
}
