// Trainer: a HybridPlan applied to a user's model (trainer.h).
#include "strata/parallel/trainer.h"

#include <fmt/format.h>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/parallel/pipeline.h"

namespace strata::parallel {

namespace {

int64_t count_parameters(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// The model's sequence::Attention modules: under sp every one must run over
// the mesh's sequence group in the plan's mode, or its positions would not
// be the ones the trainer shards.
sequence::Attention check_attention(torch::nn::Sequential& model, const DeviceMesh& mesh, const HybridPlan& plan) {
  sequence::Attention first{nullptr};
  for (const auto& item : model->named_modules()) {
    auto* a = item.value()->as<sequence::AttentionImpl>();
    if (a == nullptr) continue;
    STRATA_CHECK(plan.sp.size == 1 || a->group == mesh.group(DeviceMesh::kSequence).get(), "the model's attention ",
                 item.key(), " runs over another group than the mesh's sequence group: build it with "
                 "sequence_attention(mesh, plan)");
    STRATA_CHECK(plan.sp.size == 1 || a->options.mode == plan.sp.mode, "the model's attention ", item.key(), " runs ",
                 sequence::mode_name(a->options.mode), ", the plan says ", sequence::mode_name(plan.sp.mode),
                 ": build it with sequence_attention(mesh, plan)");
    if (!first) first = sequence::Attention(std::dynamic_pointer_cast<sequence::AttentionImpl>(item.value()));
  }
  STRATA_CHECK(plan.sp.size == 1 || first, "sp ", plan.sp.size, " splits each sequence over ranks, but the model has "
               "no sequence-parallel attention: its attention must be the plan's sequence_attention(mesh, plan) "
               "(parallel::sequence::Attention), which sees every position; plain attention would see only this "
               "rank's. Build the model with it, or set the sequence size to 1");
  return first;
}

// Under a pipeline the attached module names a parameter "stage<s>.<name>";
// the optimizer's groups select by the model's own names.
OptimizerConfig with_model_names(OptimizerConfig optimizer) {
  for (ParamGroup& g : optimizer.groups) {
    if (!g.select) continue;
    g.select = [inner = g.select](const std::string& name, const std::vector<int64_t>& shape) {
      const size_t dot = name.find('.');
      const bool staged = name.rfind("stage", 0) == 0 && dot != std::string::npos;
      return inner(staged ? name.substr(dot + 1) : name, shape);
    };
  }
  return optimizer;
}

std::vector<int> pipeline_cut(torch::nn::Sequential& model, const HybridPlan& plan) {
  if (!plan.pp.boundaries.empty() || plan.pp.trace.empty()) return plan.pp.boundaries;  // empty: balanced by parameters
  const auto costs = pipeline::trace_layer_costs(plan.pp.trace, static_cast<int>(model->size()));
  return pipeline::partition_balanced(pipeline::mixed_costs(costs, plan.pp.memory_weight),
                                      plan.pp.size * plan.pp.virtual_stages);
}

}  // namespace

sequence::Attention sequence_attention(const DeviceMesh& mesh, const HybridPlan& plan, bool causal) {
  sequence::AttentionOptions o;
  o.mode = plan.sp.mode;
  o.causal = causal;
  return sequence::Attention(mesh.group(DeviceMesh::kSequence), o);
}

Trainer::Trainer(torch::nn::Sequential model, const DeviceMesh& mesh, const HybridPlan& plan,
                 OptimizerConfig optimizer, EngineOptions options, const ModelShape& shape)
    : mesh_(mesh), plan_(plan.validated(mesh.world_size(), shape)), model_(std::move(model)) {
  STRATA_CHECK(plan_.dims() == mesh_.dims(), "the plan ", plan_.describe(), " is not the mesh's layout (",
               mesh_.describe(), "): make the mesh with DeviceMesh::create(world, plan.dims())");
  STRATA_CHECK(model_ && model_->size() > 0, "the trainer needs a model with at least one layer");
  STRATA_CHECK(plan_.tp.size == 1 || !plan_.tp.layers.empty(), "tp ", plan_.tp.size, " in mode ",
               tensor_mode_name(plan_.tp.mode), " needs the plan's tensor layers (parallelize()'s module plan: which "
               "Linear and Embedding submodules split how)");
  STRATA_CHECK(plan_.pp.size == 1 || static_cast<int64_t>(model_->size()) >= plan_.pp.size * plan_.pp.virtual_stages,
               "the model has ", model_->size(), " layers, fewer than the plan's ",
               plan_.pp.size * plan_.pp.virtual_stages, " pipeline stages");
  STRATA_CHECK(options.zero_stage == 0 || options.zero_stage == plan_.zero_stage, "the engine options ask for ZeRO "
               "stage ", options.zero_stage, " (EngineOptions::zero_stage or STRATA_ZERO_STAGE), the plan for ",
               plan_.zero_stage, ": the plan's zero_stage decides; set it there, or leave the options' at 0");
  attention_ = check_attention(model_, mesh_, plan_);
  // Collectives from here on; every check above ran on every rank alike.
  if (plan_.tp.size > 1) {
    parallelize(*model_, mesh_.group(DeviceMesh::kTensor), plan_.tp.layers, plan_.tp.mode, plan_.tp.depth);
  }
  options.zero_stage = plan_.zero_stage;
  std::shared_ptr<Communicator> replicas = mesh_.replicas()->world_size() > 1 ? mesh_.replicas() : nullptr;
  if (plan_.pp.size > 1) {
    pipeline::PipelineOptions po;
    po.schedule = plan_.pp.schedule;
    po.microbatches = plan_.pp.microbatches;
    po.virtual_stages = plan_.pp.virtual_stages;
    pipeline_ = std::make_unique<pipeline::Pipeline>(model_, mesh_.group(DeviceMesh::kPipeline), po,
                                                     pipeline_cut(model_, plan_));
    pipeline_->attach(with_model_names(std::move(optimizer)), std::move(options), replicas);
  } else {
    engine_ = attach(*model_, std::move(optimizer), std::move(options), replicas);
  }
}

Trainer::~Trainer() = default;

torch::Tensor Trainer::shard(const torch::Tensor& x) const {
  if (plan_.sp.size == 1 || !x.defined()) return x;
  return attention_->shard(x, plan_.sp.dim);
}

StepResult Trainer::step(const torch::Tensor& inputs, const torch::Tensor& targets, const LossFn& loss) {
  const torch::Tensor x = shard(inputs), y = shard(targets);
  StepResult r;
  if (pipeline_) {
    r = pipeline_->step(x, y, loss);
  } else {
    const torch::Tensor xd = engine_->to_device(x), yd = engine_->to_device(y);
    r = engine_->train_step([&] { return loss(model_->forward(xd), yd); });
  }
  // Each rank's loss is the mean over its positions: the replica's is their mean.
  if (plan_.sp.size > 1) {
    const std::vector<double> all = all_gather_values(*mesh_.group(DeviceMesh::kSequence), {r.loss});
    double sum = 0.0;
    for (double l : all) sum += l;
    r.loss = sum / static_cast<double>(all.size());
  }
  return r;
}

torch::Tensor Trainer::evaluate(const torch::Tensor& inputs) {
  const torch::Tensor x = shard(inputs);
  if (pipeline_) return pipeline_->forward(x);
  const torch::Tensor xd = engine_->to_device(x);
  return engine_->run([&] { return model_->forward(xd); });
}

void Trainer::save(const std::string& dir) {
  if (pipeline_) {
    pipeline_->save(dir);
  } else {
    engine_->save(dir);
  }
}

void Trainer::load(const std::string& dir) {
  if (pipeline_) {
    pipeline_->load(dir);
  } else {
    engine_->load(dir);
  }
}

torch::nn::Module& Trainer::module() { return pipeline_ ? pipeline_->module() : *model_; }

Engine& Trainer::engine() { return pipeline_ ? pipeline_->engine() : *engine_; }

RankReport Trainer::report() const {
  RankReport r;
  Trainer& self = const_cast<Trainer&>(*this);  // the engine's accessors are not const
  Engine& e = self.engine();
  r.rank = mesh_.rank();
  r.coords = mesh_.coords();
  r.parameters = count_parameters(self.module());
  r.model_state_bytes = e.model_state_bytes();
  for (int t = 0; t < memory::kNumTiers; ++t) {
    r.tiers[t] = e.tier_stats(static_cast<memory::Tier>(t));
    r.held_bytes += r.tiers[t].used;
  }
  r.pipeline_bytes_sent = pipeline_ ? pipeline_->bytes_sent() : 0;
  r.data_collectives = e.collectives();
  r.parameter_gathers = e.parameter_gathers();
  return r;
}

std::string RankReport::describe() const {
  std::string s = fmt::format("rank {} (dp {}, pp {}, tp {}, sp {}): {} parameters, model state {} ({} held)", rank,
                              coords[0], coords[1], coords[2], coords[3], parameters,
                              format_bytes(static_cast<uint64_t>(model_state_bytes)), format_bytes(held_bytes));
  for (int t = 0; t < memory::kNumTiers; ++t) {
    if (tiers[t].budget == 0) continue;
    s += fmt::format("; {} peak {} of {}", memory::tier_name(static_cast<memory::Tier>(t)), format_bytes(tiers[t].peak),
                     format_bytes(tiers[t].budget));
  }
  if (pipeline_bytes_sent > 0) s += fmt::format("; sent {} to pipeline neighbours", format_bytes(static_cast<uint64_t>(pipeline_bytes_sent)));
  s += fmt::format("; {} data-parallel collectives", data_collectives);
  if (parameter_gathers > 0) s += fmt::format(", {} parameter gathers", parameter_gathers);
  return s;
}

}  // namespace strata::parallel
