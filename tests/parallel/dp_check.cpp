// Run by the tests through `strata run -n N`: data-parallel strata training
// against single-process plain LibTorch on the combined batch, on every rank.
//   dp_check [--zero-stage S] [--offload] [--accumulation K] [--unused]
//   dp_check --memory
//   dp_check --checkpoint DIR --zero-stage S --load-stage T
//   dp_check --fp16
//   dp_check --bf16
//   --zero-stage    ZeRO stage 0-3 (Note [ZeRO over chunks])
//   --offload       device budget a quarter of the model state, optimizer state on NVMe
//   --accumulation  K micro-steps per step (communication only on the last)
//   --unused        a branch only rank 0 uses: its gradients exist on one rank
//                   only
//   --memory        trains at stages 0 to 3 and checks that stage 3 keeps about
//                   1/N of stage 0's model-state bytes per rank between steps
//   --checkpoint    trains 3 steps at stage S, saves to DIR, trains 2 more and
//                   exports the weights; then a fresh model loads DIR at stage T
//                   and trains the same 2 steps: parameters, each rank's RNG
//                   stream and the exported weights must match
//   --fp16          an fp16 model (master weights, loss scaling) at stages 1-3
//   --bf16          a bf16 model at stages 0-3 against one process training on every rank's batches
//                   against stage 0, with tensors spanning shards
//   --die-at-step K rank 1 dies in the middle of step K (the launcher must
//                   stop the others and name it)
//   --mismatch      rank 1 has another device budget: attach refuses on every rank
//   --branches      rank 0 routes its batch through the side branch, the others
//                   do not (data-dependent routing, as MoE): every stage
//                   trains like one process on the combined batch (at stage 3
//                   through Note [Gathers agreed in rounds])
//   --device-optim  half the chunk families' optimizer state is updated on the
//                   device while the rest is on the CPU (Note [The optimizer
//                   where its state lives]); the gathers after it stay in order
//   --device-buffers  the communicator says it takes device memory (NCCL
//                   does): gradients are accumulated and reduced on the
//                   device tier, shards gathered there, and training still
//                   matches (Note [Chunks where the communicator reads them])
//   --between       at step 1 every rank reads the gradients before the step
//                   (Engine::grad, compared with the reference's); after step 2
//                   every rank reads its parameters (compared
//                   with the reference) and clamps them under NoGradGuard, as
//                   the reference does: training goes on from the clamped
//                   values at every stage (at stage 3 the reads are collective)
//   --throw-at-step K  rank 1's loss function throws at step K: its
//                   train_step rethrows it and its engine refuses further
//                   steps; the other ranks fail when their collective times
//                   out (STRATA_COMM_TIMEOUT)
//   --reuse         layer b runs twice, in two checkpointed blocks: its
//                   gradient arrives once from each recomputation, and its
//                   family is summed over the ranks only after both
//                   (Note [Data parallel gradients])
//   --reuse-late    --reuse, the blocks checkpointed from step 2 only: b's
//                   family, learnt as final after one arrival, is summed
//                   before the others come, and the step fails on every rank
//                   naming the parameter
//   --save-fails    at stage 3, rank 0 cannot write the checkpoint (nor the
//                   weights): every rank's save() (export_weights()) fails,
//                   and training goes on in step on every rank
// Prints "rank R: data parallel matches single-process training (...)" or fails.
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <stdexcept>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>
#include <string>

#include "strata/checkpoint/safetensors.h"
#include "strata/core/error.h"
#include "strata/parallel/activation_checkpoint.h"
#include "strata/parallel/communicator.h"
#include "strata/parallel/engine.h"
#include "parallel/test_models.h"

using namespace strata::parallel;

struct Net : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, side{nullptr}, c{nullptr};
  Net() {
    a = register_module("a", torch::nn::Linear(32, 64));
    b = register_module("b", torch::nn::Linear(64, 64));
    side = register_module("side", torch::nn::Linear(64, 64));
    c = register_module("c", torch::nn::Linear(64, 8));
  }
  bool reuse = false;  // --reuse: b twice, each in a checkpointed block (the reference: the same, unchecked)
  bool checkpointed = false;
  torch::Tensor forward(const torch::Tensor& x, bool use_side) {
    torch::Tensor h = torch::relu(a->forward(x));
    if (reuse) {
      const auto block = [&](const torch::Tensor& t) { return torch::relu(b->forward(t)) + t; };
      h = checkpointed ? checkpoint(block, h) : block(h);
    }
    h = torch::relu(b->forward(h));
    if (reuse) {
      const auto block = [&](const torch::Tensor& t) { return torch::tanh(b->forward(t)) * t; };
      h = checkpointed ? checkpoint(block, h) : block(h);
    }
    // --reuse takes the side branch on every rank: unused, its family would
    // hold back b's (families are summed in descending order).
    if (use_side || reuse) h = h + torch::tanh(side->forward(h));
    return c->forward(h);
  }
};

struct Options {
  int stage = 0;
  bool offload = false, unused = false;
  int accumulation = 1;
  int64_t chunk_elems = 64 * 64 + 64;  // shards of unaligned size at 2 and 4 ranks
  int die_at_step = -1;
  bool mismatch = false;  // rank 1 has another device budget: attach must refuse on every rank
  bool branches = false;  // rank 0 alone takes the side branch, at every stage
  bool between = false;   // reads and writes between steps
  int throw_at_step = -1;
  bool device_optim = false;  // half the families' optimizer state updated on the device
  bool device_buffers = false;  // the communicator takes device memory, as NCCL (DeviceBufferGloo)
  bool reuse = false;           // a layer in two checkpointed blocks
  bool reuse_late = false;      // from step 2 only
};

// Gloo presented as a communicator of device buffers, as NCCL is: the engine
// then keeps the chunks it communicates on the device tier (Note [Chunks
// where the communicator reads them]). On the emulated device that memory
// is host memory, so Gloo's collectives read it as NCCL's would read a GPU's.
class DeviceBufferGloo final : public Communicator {
 public:
  explicit DeviceBufferGloo(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string backend() const override { return inner_->backend(); }
  bool device_buffers() const override { return true; }
  WorkHandle all_reduce(void* b, size_t n, strata::DType d, ReduceOp op) override { return inner_->all_reduce(b, n, d, op); }
  WorkHandle reduce_scatter(const void* i, void* o, size_t n, strata::DType d, ReduceOp op) override {
    return inner_->reduce_scatter(i, o, n, d, op);
  }
  WorkHandle all_gather(const void* i, void* o, size_t n, strata::DType d) override { return inner_->all_gather(i, o, n, d); }
  WorkHandle broadcast(void* b, size_t n, strata::DType d, int root) override { return inner_->broadcast(b, n, d, root); }
  WorkHandle all_to_all(const void* i, void* o, size_t n, strata::DType d) override { return inner_->all_to_all(i, o, n, d); }
  WorkHandle send(const void* b, size_t n, int peer, uint32_t tag) override { return inner_->send(b, n, peer, tag); }
  WorkHandle recv(void* b, size_t n, int peer, uint32_t tag) override { return inner_->recv(b, n, peer, tag); }
  WorkHandle barrier() override { return inner_->barrier(); }
  std::unique_ptr<Communicator> split(const std::vector<int>& ranks, const std::string& name) override {
    return std::make_unique<DeviceBufferGloo>(std::shared_ptr<Communicator>(inner_->split(ranks, name)));
  }

 private:
  std::shared_ptr<Communicator> inner_;
};

// Gradient chunks (and shards) resident on the device tier now.
int grads_on_device(Engine& engine) {
  strata::memory::ChunkManager& mgr = engine.chunks();
  int n = 0;
  for (size_t c = 0; c < mgr.num_chunks(); ++c) {
    const strata::memory::Chunk& chunk = mgr.chunk(static_cast<strata::memory::ChunkId>(c));
    n += chunk.role() == strata::memory::ChunkRole::kGrad && chunk.location() == strata::memory::Tier::kDevice;
  }
  return n;
}

struct Outcome {
  double worst = 0;           // relative L2 difference from single-process training
  uint64_t between = 0;       // model-state bytes on all tiers after the last step
  uint64_t peaks = 0;         // sum of the tiers' peaks
  uint64_t device_peak = 0;
  int64_t gathers = 0;
  int64_t gathers_ahead = 0;
};

// Trains a fresh model on every rank and its single-process reference.
Outcome train(const std::shared_ptr<Communicator>& plain, const Options& opt) {
  const std::shared_ptr<Communicator> comm =
      opt.device_buffers ? std::make_shared<DeviceBufferGloo>(plain) : plain;
  const int rank = comm->rank(), world = comm->world_size();
  torch::manual_seed(100 + rank);  // replicas start apart: attach broadcasts rank 0's parameters
  auto model = std::make_shared<Net>();
  torch::manual_seed(1);
  auto reference = std::make_shared<Net>();  // rank 0's initial weights, as in every rank's reference
  model->reuse = reference->reuse = opt.reuse || opt.reuse_late;
  model->checkpointed = !opt.reuse_late;
  if (rank == 0) {
    torch::NoGradGuard g;
    auto src = reference->parameters();
    auto dst = model->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  AdamWConfig cfg;
  cfg.lr = 1e-2f;
  torch::optim::AdamW adamw(reference->parameters(), torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay));
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  EngineOptions o;
  o.zero_stage = opt.stage;
  o.chunk_elems = opt.chunk_elems;
  o.grad_accumulation = opt.accumulation;
  o.budgets = {static_cast<uint64_t>(params) * 16, static_cast<uint64_t>(params) * 32, 0};
  const std::string nvme = "/tmp/strata-dp-check-" + std::to_string(::getpid());
  if (opt.offload) {
    o.budgets = {static_cast<uint64_t>(params) * 16 / 4 / 4096 * 4096 + 8192, static_cast<uint64_t>(params) * 16,
                 static_cast<uint64_t>(params) * 64};
    o.nvme_dir = nvme;
    o.nvme_optim_fraction = 1.0;
  }
  if (opt.mismatch && rank == 1) o.budgets.device += 4096;
  if (opt.device_optim) o.device_optim_fraction = 0.5;
  // Stage 3 gathers parameters for operators: every rank must use the same ones.
  const auto uses_side = [&](int r) { return r == 0 && (opt.unused || opt.branches); };
  const int steps = 5, batch = 8;
  Outcome out;
  int64_t grad_gathers = 0;  // Engine::grad at stages 2-3: one gather of the shards each
  {
    auto engine = attach(*model, cfg, o, comm);
    STRATA_CHECK(engine->zero_stage() == opt.stage, "engine runs stage ", engine->zero_stage());
    for (int s = 0; s < steps; ++s) {
      adamw.zero_grad();
      for (auto& p : reference->parameters()) p.mutable_grad() = torch::Tensor();
      for (int m = 0; m < opt.accumulation; ++m) {
        torch::manual_seed(1000 + s * 10 + m);  // the same combined batch on every rank
        const torch::Tensor x = torch::randn({world * batch, 32}), y = torch::randn({world * batch, 8});
        // Reference: the mean over ranks of each rank's loss, on one process.
        torch::Tensor ref = torch::zeros({});
        for (int r = 0; r < world; ++r) {
          ref = ref + torch::mse_loss(reference->forward(x.slice(0, r * batch, (r + 1) * batch), uses_side(r)),
                                      y.slice(0, r * batch, (r + 1) * batch));
        }
        (ref / (world * opt.accumulation)).backward();
        const torch::Tensor xr = x.slice(0, rank * batch, (rank + 1) * batch), yr = y.slice(0, rank * batch, (rank + 1) * batch);
        const auto loss_fn = [&] {
          torch::Tensor loss = torch::mse_loss(model->forward(xr, uses_side(rank)), yr);
          if (s == opt.die_at_step && rank == 1) std::_Exit(3);  // after forward, before backward's collectives
          if (s == opt.throw_at_step && rank == 1) throw std::runtime_error("user code failed at step " + std::to_string(s));
          return loss;
        };
        if (opt.reuse_late && s == 2) {  // b's gradient arrives three times now, once before: refused on every rank
          model->checkpointed = true;
          std::string got = "no error";
          try {
            engine->train_step(loss_fn);
          } catch (const strata::Error& e) {
            got = e.what();
          }
          STRATA_CHECK(got.find("the model uses this parameter more often than in the step before") !=
                           std::string::npos, "rank ", rank, ": a layer used more often than before: ", got);
          std::printf("rank %d: refused: %s\n", rank, got.substr(0, got.find(" after")).c_str());
          std::fflush(stdout);
          std::_Exit(0);  // the engine refuses further steps
        }
        if (s == opt.throw_at_step && rank == 1) {
          try {
            engine->train_step(loss_fn);
          } catch (const std::exception& e) {
            std::fprintf(stderr, "rank 1: train_step failed: %s\n", e.what());
          }
          try {
            engine->train_step(loss_fn);
          } catch (const std::exception& e) {
            std::fprintf(stderr, "rank 1: the next train_step refused: %s\n", e.what());
          }
          std::fflush(stderr);
          ::sleep(60);  // the other ranks time out meanwhile; the launcher stops this one
          std::_Exit(1);
        }
        // --between, step 1: the gradients the step will apply equal the reference's
        // (at stages 2-3 grad() gathers shards: every rank asks for the same ones).
        const auto check_grads = [&] {
          auto pr = reference->named_parameters();
          for (const auto& item : model->named_parameters()) {
            const torch::Tensor g = engine->grad(item.value());
            const torch::Tensor want = pr[item.key()].grad();
            STRATA_CHECK(g.defined() == want.defined(), "rank ", rank, ": ", item.key(), " gradient defined ",
                         g.defined(), ", the reference's ", want.defined());
            if (!g.defined()) continue;
            grad_gathers += opt.stage >= 2 ? 1 : 0;
            const double diff = ((g - want).norm() / want.norm().clamp_min(1e-12)).item<double>();
            STRATA_CHECK(diff < 1e-5, "rank ", rank, ": engine->grad(", item.key(), ") differs from the reference's "
                         "gradient by ", diff);
          }
        };
        const bool last = m + 1 == opt.accumulation;
        // --device-buffers: the reduced gradients are on the device tier when the step begins.
        const auto grads_stay_on_device = [&] {
          STRATA_CHECK(grads_on_device(*engine) > 0, "rank ", rank, ": no gradient chunk on the device tier before the "
                       "step, with a communicator of device buffers");
        };
        std::function<void()> before;
        if (opt.between && s == 1 && last) before = check_grads;
        if (opt.device_buffers && last) before = grads_stay_on_device;
        engine->train_step(loss_fn, before);
      }
      adamw.step();
      if (opt.between && s == 2) {
        // Between steps: reads give the reference's values; a clamp lands in the master weights.
        auto pr = reference->named_parameters();
        for (const auto& item : model->named_parameters()) {
          const double got = item.value().abs().sum().item<double>();
          const double want = pr[item.key()].abs().sum().item<double>();
          STRATA_CHECK(std::fabs(got - want) <= 1e-5 * want, "rank ", rank, ": ", item.key(), " reads ", got,
                       " between steps, the reference ", want);
        }
        torch::NoGradGuard no_grad;
        for (auto& p : reference->parameters()) p.clamp_(-0.05, 0.05);
        for (auto& p : model->parameters()) p.clamp_(-0.05, 0.05);
      }
    }
    // Attach broadcasts every parameter; each step reduces every family and
    // the flags; stages 1-2 gather each family's parameters after the step;
    // stages 2-3 sum the gradient norm's shards. Accumulation micro-steps
    // communicate nothing.
    const int64_t families = static_cast<int64_t>(engine->num_families());
    int64_t expected = static_cast<int64_t>(model->parameters().size()) + steps * (families + 1);
    if (opt.stage == 1 || opt.stage == 2) expected += steps * families;
    if (opt.stage >= 2) expected += steps;
    expected += grad_gathers;
    STRATA_CHECK(engine->collectives() == expected, "issued ", engine->collectives(), " collectives, expected ",
                 expected);
    STRATA_CHECK((engine->parameter_gathers() > 0) == (opt.stage == 3), "stage ", opt.stage, " gathered parameters ",
                 engine->parameter_gathers(), " times");
    // From the second step the recorded operator sequence drives prefetch:
    // some gathers are issued before the operator that needs them.
    STRATA_CHECK((engine->parameter_gathers_ahead() > 0) == (opt.stage == 3), "stage ", opt.stage, " prefetched ",
                 engine->parameter_gathers_ahead(), " of ", engine->parameter_gathers(), " parameter gathers");
    out.gathers_ahead = engine->parameter_gathers_ahead();
    const auto dev = engine->tier_stats(strata::memory::Tier::kDevice);
    STRATA_CHECK(dev.peak <= dev.budget, "device peak over budget");
    for (auto t : {strata::memory::Tier::kDevice, strata::memory::Tier::kHost, strata::memory::Tier::kNvme}) {
      out.between += engine->tier_stats(t).used;
      out.peaks += engine->tier_stats(t).peak;
    }
    out.device_peak = dev.peak;
    out.gathers = engine->parameter_gathers();
  }  // detached: the module holds the trained weights
  auto pa = reference->parameters();
  auto pb = model->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    out.worst = std::max(out.worst, ((pa[i] - pb[i]).norm() / pa[i].norm()).item<double>());
  }
  if (opt.offload) std::filesystem::remove_all(nvme);
  return out;
}

// Trains Scaler in `precision` (fp16 by default) at `stage`; returns the
// trained fp32 parameters. With `whole_batch` it trains alone (no
// communicator) on every rank's batches at once: what data parallelism over
// `world` ranks computes.
std::vector<torch::Tensor> train_fp16(const std::shared_ptr<Communicator>& comm, int stage,
                                      strata::DType precision = strata::DType::kFloat16, bool whole_batch = false) {
  torch::manual_seed(3);
  auto model = std::make_shared<Scaler>();
  EngineOptions o;
  o.precision = precision;
  o.zero_stage = stage;
  o.chunk_elems = 1000;  // the embedding gets a chunk of its own, split across every rank's shard
  o.budgets = {1 << 20, 4 << 20, 0};
  AdamWConfig cfg;
  cfg.lr = 1e-2f;
  {
    auto engine = attach(*model, cfg, o, whole_batch ? nullptr : comm);
    torch::manual_seed(21);
    const torch::Tensor table = torch::randn({64, 32}) * 0.5;
    for (int s = 0; s < 6; ++s) {
      std::vector<torch::Tensor> batches;
      for (int r = 0; r < comm->world_size(); ++r) {
        if (!whole_batch && r != comm->rank()) continue;
        torch::manual_seed(40 + s * 7 + r);
        batches.push_back(torch::randint(0, 64, {8, 4}));
      }
      const torch::Tensor tokens = engine->to_device(torch::cat(batches));
      const torch::Tensor target =
          engine->to_device(table.index_select(0, tokens.flatten()).view({tokens.size(0), 4, 32}));
      engine->train_step([&] { return (model->forward(tokens) - target).pow(2).mean().to(torch::kFloat32); });
    }
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

// One step of training on the same per-rank batch as train() uses.
void step(Engine& engine, Net& model, int rank, int s) {
  torch::manual_seed(1000 + s * 10);
  const torch::Tensor x = torch::randn({8, 32}) + rank, y = torch::randn({8, 8});
  engine.train_step([&] { return torch::mse_loss(model.forward(x, false), y); });
}

// See --checkpoint: save at one stage, load at another, continue identically.
void checkpoint_check(const std::shared_ptr<Communicator>& comm, int save_stage, int load_stage, const std::string& dir) {
  const int rank = comm->rank();
  AdamWConfig cfg;
  cfg.lr = 1e-2f;
  EngineOptions o;
  o.chunk_elems = 64 * 64 + 64;
  o.budgets = {1 << 20, 4 << 20, 0};
  const std::string weights = dir + ".safetensors";
  torch::Tensor drawn;
  std::vector<torch::Tensor> straight;
  auto a = std::make_shared<Net>();
  {
    o.zero_stage = save_stage;
    auto engine = attach(*a, cfg, o, comm);
    for (int s = 0; s < 3; ++s) step(*engine, *a, rank, s);
    torch::manual_seed(500 + rank);  // each rank's own stream from here
    engine->save(dir);
    drawn = torch::rand({4});
    for (int s = 3; s < 5; ++s) step(*engine, *a, rank, s);
    engine->export_weights(weights);
  }
  for (const auto& p : a->parameters()) straight.push_back(p.detach().clone());
  auto b = std::make_shared<Net>();  // other initial weights: all must come from the checkpoint
  {
    o.zero_stage = load_stage;
    auto engine = attach(*b, cfg, o, comm);
    engine->load(dir);
    const torch::Tensor again = torch::rand({4});
    STRATA_CHECK(torch::equal(drawn, again), "rank ", rank, ": the RNG stream after load differs from the saved one");
    for (int s = 3; s < 5; ++s) step(*engine, *b, rank, s);
  }
  double worst = 0;
  auto pb = b->parameters();
  for (size_t i = 0; i < pb.size(); ++i) {
    worst = std::max(worst, ((straight[i] - pb[i]).norm() / straight[i].norm()).item<double>());
  }
  STRATA_CHECK(worst < 1e-6, "rank ", rank, ": saved at stage ", save_stage, " and resumed at stage ", load_stage,
               ", parameters differ from straight training by ", worst);
  // The exported weights are the trained ones, whole, whatever the stage.
  strata::checkpoint::SafetensorsReader r(weights);
  auto named = a->named_parameters();
  for (size_t i = 0; i < named.size(); ++i) {
    const auto* t = r.header().find(named[i].key());
    STRATA_CHECK(t != nullptr, weights, " lacks ", named[i].key());
    torch::Tensor v = torch::empty(t->shape, torch::kFloat32);
    r.read(*t, 0, v.data_ptr(), static_cast<size_t>(v.numel()) * sizeof(float));
    STRATA_CHECK(torch::equal(v, straight[i]), "exported ", named[i].key(), " differs from the trained parameter");
  }
  std::printf("rank %d: saved at ZeRO stage %d, resumed at stage %d: parameters match straight training (worst "
              "relative difference %.2e), RNG stream and exported weights too\n", rank, save_stage, load_stage, worst);
}

// See --save-fails.
void save_fails_check(const std::shared_ptr<Communicator>& comm) {
  const int rank = comm->rank();
  auto model = std::make_shared<Net>();
  EngineOptions o;
  o.zero_stage = 3;
  o.chunk_elems = 64 * 64 + 64;
  o.budgets = {1 << 20, 4 << 20, 0};
  auto engine = attach(*model, AdamWConfig{}, o, comm);
  step(*engine, *model, rank, 0);
  std::string error;
  try {
    engine->save("/proc/strata-cannot-write-here/checkpoint");  // rank 0 cannot create it
  } catch (const std::exception& e) {
    error = e.what();
  }
  STRATA_CHECK(!error.empty(), "rank ", rank, ": save() succeeded where rank 0 cannot write");
  bool exported = true;
  try {
    engine->export_weights("/proc/strata-cannot-write-here/weights.safetensors");
  } catch (const std::exception&) {
    exported = false;
  }
  STRATA_CHECK(!exported, "rank ", rank, ": export_weights() succeeded where rank 0 cannot write");
  step(*engine, *model, rank, 1);  // the ranks' collectives are still paired
  std::printf("rank %d: save failed on every rank (%s), so did the export; training went on\n", rank,
              error.substr(0, error.find(" (/")).c_str());
}

int main(int argc, char** argv) {
  Options opt;
  bool save_fails = false;
  bool fp16 = false;
  bool bf16 = false;
  std::string checkpoint;
  int load_stage = 0;
  bool memory = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--offload") opt.offload = true;
    if (a == "--unused") opt.unused = true;
    if (a == "--memory") memory = true;
    if (a == "--fp16") fp16 = true;
    if (a == "--bf16") bf16 = true;
    if (a == "--mismatch") opt.mismatch = true;
    if (a == "--branches") opt.branches = true;
    if (a == "--reuse") opt.reuse = true;
    if (a == "--reuse-late") opt.reuse_late = true;
    if (a == "--between") opt.between = true;
    if (a == "--device-optim") opt.device_optim = true;
    if (a == "--device-buffers") opt.device_buffers = true;
    if (a == "--throw-at-step" && i + 1 < argc) opt.throw_at_step = std::atoi(argv[++i]);
    if (a == "--save-fails") save_fails = true;
    if (a == "--die-at-step" && i + 1 < argc) opt.die_at_step = std::atoi(argv[++i]);
    if (a == "--accumulation" && i + 1 < argc) opt.accumulation = std::atoi(argv[++i]);
    if (a == "--zero-stage" && i + 1 < argc) opt.stage = std::atoi(argv[++i]);
    if (a == "--load-stage" && i + 1 < argc) load_stage = std::atoi(argv[++i]);
    if (a == "--checkpoint" && i + 1 < argc) checkpoint = argv[++i];
  }
  try {
    std::shared_ptr<Communicator> comm = make_gloo_communicator(Rendezvous::from_env());
    const int rank = comm->rank(), world = comm->world_size();
    if (!checkpoint.empty()) {
      checkpoint_check(comm, opt.stage, load_stage, checkpoint);
      return 0;
    }
    if (save_fails) {
      save_fails_check(comm);
      return 0;
    }
    if (bf16) {
      // N ranks against one process on all their batches (bf16 sums over
      // Gloo: Note [bf16 over Gloo]), at every stage: bf16's usual tolerance.
      const std::vector<torch::Tensor> alone = train_fp16(comm, 0, strata::DType::kBFloat16, /*whole_batch=*/true);
      for (int stage = 0; stage <= 3; ++stage) {
        const std::vector<torch::Tensor> got = train_fp16(comm, stage, strata::DType::kBFloat16);
        double worst = 0;
        for (size_t i = 0; i < alone.size(); ++i) {
          worst = std::max(worst, ((got[i] - alone[i]).norm() / alone[i].norm()).item<double>());
        }
        STRATA_CHECK(worst < 2e-2, "rank ", rank, ": bf16 on ", world, " ranks at stage ", stage,
                     " differs from one process on all their batches by ", worst);
        std::printf("rank %d: bf16 on %d ranks at ZeRO stage %d matches one process (worst relative difference %.2e)\n",
                    rank, world, stage, worst);
      }
      return 0;
    }
    if (fp16) {
      const std::vector<torch::Tensor> base = train_fp16(comm, 0);
      for (int stage = 1; stage <= 3; ++stage) {
        const std::vector<torch::Tensor> got = train_fp16(comm, stage);
        double worst = 0;
        for (size_t i = 0; i < base.size(); ++i) {
          worst = std::max(worst, ((got[i] - base[i]).norm() / base[i].norm()).item<double>());
        }
        STRATA_CHECK(worst < 1e-3, "rank ", rank, ": fp16 at stage ", stage, " differs from stage 0 by ", worst);
        std::printf("rank %d: fp16 at ZeRO stage %d matches stage 0 (worst relative difference %.2e)\n", rank, stage,
                    worst);
      }
      return 0;
    }
    if (memory) {
      std::vector<Outcome> by_stage;
      for (int stage = 0; stage <= 3; ++stage) {
        Options o = opt;
        o.stage = stage;
        // Shards of whole 4 KiB pages at 2 and 4 ranks, so that alignment
        // padding does not blur the comparison.
        o.chunk_elems = 8192;
        by_stage.push_back(train(comm, o));
        const Outcome& r = by_stage.back();
        STRATA_CHECK(r.worst < 1e-5, "rank ", rank, ", stage ", stage, ": parameters differ by ", r.worst);
        std::printf("rank %d: stage %d model state between steps %llu bytes, sum of tier peaks %llu, device peak "
                    "%llu, parameter gathers %lld\n",
                    rank, stage, static_cast<unsigned long long>(r.between), static_cast<unsigned long long>(r.peaks),
                    static_cast<unsigned long long>(r.device_peak), static_cast<long long>(r.gathers));
      }
      const double ratio = static_cast<double>(by_stage[3].between) / static_cast<double>(by_stage[0].between);
      STRATA_CHECK(ratio <= 1.0 / world * 1.1, "rank ", rank, ": stage 3 keeps ", ratio,
                   " of stage 0's model-state bytes, expected about 1/", world);
      STRATA_CHECK(by_stage[1].between < by_stage[0].between && by_stage[3].between < by_stage[2].between,
                   "sharding more did not keep fewer bytes");
      std::printf("rank %d: stage 3 keeps %.3f of stage 0's model-state bytes (1/%d = %.3f)\n", rank, ratio, world,
                  1.0 / world);
      return 0;
    }
    const Outcome r = train(comm, opt);
    const double worst = r.worst;
    if (opt.stage == 3) {
      std::printf("rank %d: %lld parameter gathers, %lld of them prefetched\n", rank, static_cast<long long>(r.gathers),
                  static_cast<long long>(r.gathers_ahead));
    }
    STRATA_CHECK(worst < 1e-5, "rank ", rank, ": parameters differ from single-process training by ", worst,
                 " (relative L2)");
    std::printf("rank %d: data parallel (ZeRO stage %d) matches single-process training (worst relative difference "
                "%.2e)\n", rank, opt.stage, worst);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_check: %s\n", e.what());
    return 1;
  }
  return 0;
}
