#pragma once
// The optimizer the engine runs over chunk families: its kind and
// hyper-parameters, parameter groups with their own, and the learning-rate
// schedule. LibTorch-free: tools and configuration code include it alone.
//
// Each kind is the fused CPU kernel of kernels/optim.h and behaves as its
// torch::optim counterpart: AdamW (decoupled weight decay), Adam (L2 weight
// decay added to the gradient), SGD (momentum, dampening, Nesterov; weight
// decay added to the gradient) and Lion (Chen et al. 2023, which torch lacks:
// sign of an interpolated momentum, decoupled weight decay). A parameter
// without a gradient in a step is not updated, as in torch::optim.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace strata::parallel {

struct AdamWConfig;

enum class OptimizerKind {
  kAdamW,  // state: exp_avg, exp_avg_sq
  kAdam,   // state: exp_avg, exp_avg_sq
  kLion,   // state: exp_avg
  kSgd,    // state: momentum_buffer (none without momentum)
};
const char* optimizer_name(OptimizerKind kind);
/// "adamw", "adam", "lion" or "sgd"; anything else is an error naming the choices.
OptimizerKind parse_optimizer(const std::string& name);

/// A parameter group: the parameters `select` takes, with hyper-parameters of
/// their own where set (the optimizer's otherwise). Groups are tried in
/// order; the first that selects a parameter takes it, and parameters no
/// group takes form the group "default".
struct ParamGroup {
  std::string name;
  /// Called with each trainable parameter's name (as named_parameters() gives
  /// it) and shape.
  std::function<bool(const std::string& name, const std::vector<int64_t>& shape)> select;
  std::optional<double> lr;
  std::optional<double> weight_decay;
  std::optional<double> beta1, beta2;  // Adam(W), Lion
  std::optional<double> eps;           // Adam(W)
  std::optional<double> momentum;      // SGD
};

/// The parameters whose names match any of `patterns` (globs: `*` any run of
/// characters, `?` one; `layers.*.bias`, `*norm*`).
ParamGroup group_by_names(std::string name, std::vector<std::string> patterns);
/// Whether `name` matches glob `pattern` as a whole.
bool glob_match(const std::string& pattern, const std::string& name);

/// The learning rate over optimizer steps, as a factor of each group's lr.
/// Warm-up is linear from `warmup_start_factor` to 1 over `warmup_steps`
/// (torch's LinearLR(start_factor, 1.0, warmup_steps); with start factor 0,
/// the usual t / warmup_steps); then cosine (torch's CosineAnnealingLR with
/// T_max = total_steps - warmup_steps and eta_min = min_lr_ratio x lr) or
/// linear (LinearLR(1.0, min_lr_ratio, total_steps - warmup_steps)) decay,
/// the two chained as torch's SequentialLR with the milestone at
/// warmup_steps. From total_steps on the factor stays min_lr_ratio. Step k
/// (0-based) of the optimizer uses factor(k): torch's scheduler.step() after
/// every optimizer.step(). Steps skipped for fp16 overflow do not advance it
/// (as DeepSpeed).
struct LrSchedule {
  enum class Kind { kConstant, kWarmupCosine, kWarmupLinear };
  Kind kind = Kind::kConstant;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;  // warm-up included
  double warmup_start_factor = 0.0;
  double min_lr_ratio = 0.0;

  static LrSchedule constant() { return {}; }
  static LrSchedule warmup_cosine(int64_t warmup_steps, int64_t total_steps, double min_lr_ratio = 0.0,
                                  double warmup_start_factor = 0.0);
  static LrSchedule warmup_linear(int64_t warmup_steps, int64_t total_steps, double min_lr_ratio = 0.0,
                                  double warmup_start_factor = 0.0);
  /// The factor the `step`-th optimizer step (0-based) multiplies each group's lr by.
  double factor(int64_t step) const;
  const char* kind_name() const;
  /// Throws strata::Error saying what to change.
  void validate() const;
};

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  double momentum = 0.0;  // SGD
  double dampening = 0.0;
  bool nesterov = false;
  std::vector<ParamGroup> groups;
  LrSchedule schedule;

  /// torch::optim::AdamW's defaults.
  static OptimizerConfig adamw(double lr = 1e-3, double weight_decay = 1e-2, double beta1 = 0.9,
                               double beta2 = 0.999, double eps = 1e-8);
  /// torch::optim::Adam's defaults (L2 weight decay).
  static OptimizerConfig adam(double lr = 1e-3, double weight_decay = 0.0, double beta1 = 0.9, double beta2 = 0.999,
                              double eps = 1e-8);
  /// Lion's published defaults (lr 3-10x smaller than AdamW's, weight decay 3-10x larger).
  static OptimizerConfig lion(double lr = 1e-4, double weight_decay = 0.0, double beta1 = 0.9, double beta2 = 0.99);
  static OptimizerConfig sgd(double lr, double momentum = 0.0, double weight_decay = 0.0, bool nesterov = false,
                             double dampening = 0.0);
  /// The AdamW configuration the first engine API took.
  static OptimizerConfig from(const AdamWConfig& adamw);

  /// fp32 state arrays per parameter: 2 for Adam(W), 1 for Lion and for SGD with momentum, else 0.
  int state_count() const;
  /// The names of those arrays in checkpoints (torch's state names).
  std::vector<std::string> state_names() const;
  /// Checks the hyper-parameters, the groups' and the schedule; throws strata::Error saying what to change.
  void validate() const;
};

}  // namespace strata::parallel
