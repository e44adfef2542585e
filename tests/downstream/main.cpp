// A user's program built against the installed strata: attaches the engine to
// a LibTorch model with AdamW, a no-decay group and a warm-up schedule, and
// checks that it trains like torch::optim::AdamW with the same groups and
// learning rates. Exit status 0 only when it does.
#include <strata/parallel/engine.h>
#include <torch/torch.h>

#include <cstdio>

int main() {
  namespace sp = strata::parallel;
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  torch::nn::Sequential reference(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < model->parameters().size(); ++i) reference->parameters()[i].copy_(model->parameters()[i]);
  }
  sp::OptimizerConfig adamw = sp::OptimizerConfig::adamw(1e-2, 0.1);
  adamw.groups.push_back(sp::no_decay_group(*model));
  adamw.schedule = sp::LrSchedule::warmup_cosine(2, 8);
  sp::EngineOptions options;
  options.budgets = strata::memory::TierBudgets::from_strings("16KiB", "1MiB", "0");
  options.chunk_elems = 512;
  auto engine = sp::attach(*model, adamw, options);

  std::vector<torch::optim::OptimizerParamGroup> groups;
  const auto named = reference->named_parameters();
  for (const std::string& g : engine->param_groups()) {
    std::vector<torch::Tensor> params;
    for (const std::string& name : engine->group_parameters(g)) params.push_back(named[name]);
    groups.emplace_back(params, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(1e-2).weight_decay(g == "no_decay" ? 0.0 : 0.1)));
  }
  torch::optim::AdamW opt(groups, torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 8; ++step) {
    const torch::Tensor x = torch::randn({8, 16}), y = torch::randn({8, 4});
    for (auto& g : opt.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(g.options()).lr(1e-2 * adamw.schedule.factor(step));
    }
    opt.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    opt.step();
    const sp::StepResult r = engine->train_step([&] { return torch::mse_loss(model->forward(x), y); });
    std::printf("step %d loss %.6f lr %.5f\n", step, r.loss, engine->lr());
  }
  engine.reset();
  double worst = 0;
  for (size_t i = 0; i < model->parameters().size(); ++i) {
    const torch::Tensor a = model->parameters()[i], b = reference->parameters()[i];
    worst = std::max(worst, ((a - b).norm() / b.norm()).item<double>());
  }
  std::printf("downstream: worst relative difference from torch::optim::AdamW %.3e\n", worst);
  return worst < 1e-5 ? 0 : 1;
}
