#include "strata/parallel/optimizer.h"

#include <cmath>

#include "strata/core/enum_names.h"
#include "strata/core/error.h"
#include "strata/parallel/engine_options.h"

namespace strata::parallel {

namespace {
constexpr double kPi = 3.14159265358979323846;

void check_hyper(const std::string& where, const std::optional<double>& lr, const std::optional<double>& wd,
                 const std::optional<double>& beta1, const std::optional<double>& beta2,
                 const std::optional<double>& eps, const std::optional<double>& momentum) {
  const auto finite = [](double v) { return std::isfinite(v); };
  STRATA_CHECK(!lr || (finite(*lr) && *lr >= 0), where, ": lr must be a finite number >= 0, got ", *lr);
  STRATA_CHECK(!wd || (finite(*wd) && *wd >= 0), where, ": weight_decay must be a finite number >= 0, got ", *wd);
  STRATA_CHECK(!beta1 || (*beta1 >= 0 && *beta1 < 1), where, ": beta1 must be in [0, 1), got ", *beta1);
  STRATA_CHECK(!beta2 || (*beta2 >= 0 && *beta2 < 1), where, ": beta2 must be in [0, 1), got ", *beta2);
  STRATA_CHECK(!eps || (finite(*eps) && *eps > 0), where, ": eps must be a finite number > 0, got ", *eps);
  STRATA_CHECK(!momentum || (finite(*momentum) && *momentum >= 0), where, ": momentum must be >= 0, got ",
               *momentum);
}
}  // namespace

namespace {
constexpr EnumName<OptimizerKind> kOptimizerNames[] = {{OptimizerKind::kAdamW, "adamw"},
                                                       {OptimizerKind::kAdam, "adam"},
                                                       {OptimizerKind::kLion, "lion"},
                                                       {OptimizerKind::kSgd, "sgd"}};
}  // namespace

const char* optimizer_name(OptimizerKind kind) { return enum_name(kOptimizerNames, kind); }

OptimizerKind parse_optimizer(const std::string& name) { return parse_enum(kOptimizerNames, name, "optimizer", "choose"); }

bool glob_match(const std::string& pattern, const std::string& name) {
  // Iterative wildcard match with one backtrack point for the last `*`.
  size_t p = 0, n = 0, star = std::string::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (star != std::string::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

ParamGroup group_by_names(std::string name, std::vector<std::string> patterns) {
  ParamGroup g;
  g.name = std::move(name);
  g.select = [patterns = std::move(patterns)](const std::string& param, const std::vector<int64_t>&) {
    for (const std::string& p : patterns) {
      if (glob_match(p, param)) return true;
    }
    return false;
  };
  return g;
}

LrSchedule LrSchedule::warmup_cosine(int64_t warmup_steps, int64_t total_steps, double min_lr_ratio,
                                     double warmup_start_factor) {
  return {Kind::kWarmupCosine, warmup_steps, total_steps, warmup_start_factor, min_lr_ratio};
}

LrSchedule LrSchedule::warmup_linear(int64_t warmup_steps, int64_t total_steps, double min_lr_ratio,
                                     double warmup_start_factor) {
  return {Kind::kWarmupLinear, warmup_steps, total_steps, warmup_start_factor, min_lr_ratio};
}

double LrSchedule::factor(int64_t step) const {
  if (kind == Kind::kConstant) return 1.0;
  if (step < warmup_steps) {
    return warmup_start_factor +
           (1.0 - warmup_start_factor) * static_cast<double>(step) / static_cast<double>(warmup_steps);
  }
  const int64_t span = total_steps - warmup_steps;
  const int64_t t = step - warmup_steps;
  if (span <= 0 || t >= span) return min_lr_ratio;
  const double progress = static_cast<double>(t) / static_cast<double>(span);
  if (kind == Kind::kWarmupCosine) return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 + std::cos(kPi * progress)) / 2;
  return 1.0 + (min_lr_ratio - 1.0) * progress;
}

const char* LrSchedule::kind_name() const {
  switch (kind) {
    case Kind::kConstant: return "constant";
    case Kind::kWarmupCosine: return "warmup_cosine";
    case Kind::kWarmupLinear: return "warmup_linear";
  }
  return "?";
}

void LrSchedule::validate() const {
  if (kind == Kind::kConstant) return;
  STRATA_CHECK(warmup_steps >= 0 && total_steps >= warmup_steps, "lr schedule ", kind_name(), ": warmup_steps (",
               warmup_steps, ") must be >= 0 and at most total_steps (", total_steps, ")");
  STRATA_CHECK(warmup_start_factor >= 0 && warmup_start_factor <= 1, "lr schedule ", kind_name(),
               ": warmup_start_factor must be in [0, 1], got ", warmup_start_factor);
  STRATA_CHECK(min_lr_ratio >= 0 && min_lr_ratio <= 1, "lr schedule ", kind_name(),
               ": min_lr_ratio must be in [0, 1], got ", min_lr_ratio);
}

OptimizerConfig OptimizerConfig::adamw(double lr, double weight_decay, double beta1, double beta2, double eps) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdamW;
  c.lr = lr;
  c.weight_decay = weight_decay;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.eps = eps;
  return c;
}

OptimizerConfig OptimizerConfig::adam(double lr, double weight_decay, double beta1, double beta2, double eps) {
  OptimizerConfig c = adamw(lr, weight_decay, beta1, beta2, eps);
  c.kind = OptimizerKind::kAdam;
  return c;
}

OptimizerConfig OptimizerConfig::lion(double lr, double weight_decay, double beta1, double beta2) {
  OptimizerConfig c = adamw(lr, weight_decay, beta1, beta2);
  c.kind = OptimizerKind::kLion;
  return c;
}

OptimizerConfig OptimizerConfig::sgd(double lr, double momentum, double weight_decay, bool nesterov,
                                     double dampening) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.lr = lr;
  c.momentum = momentum;
  c.weight_decay = weight_decay;
  c.nesterov = nesterov;
  c.dampening = dampening;
  return c;
}

OptimizerConfig OptimizerConfig::from(const AdamWConfig& a) {
  return adamw(a.lr, a.weight_decay, a.beta1, a.beta2, a.eps);
}

int OptimizerConfig::state_count() const { return static_cast<int>(state_names().size()); }

std::vector<std::string> OptimizerConfig::state_names() const {
  switch (kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: return {"exp_avg", "exp_avg_sq"};
    case OptimizerKind::kLion: return {"exp_avg"};
    case OptimizerKind::kSgd: {
      if (momentum > 0) return {"momentum_buffer"};
      for (const ParamGroup& g : groups) {
        if (g.momentum && *g.momentum > 0) return {"momentum_buffer"};
      }
      return {};
    }
  }
  return {};
}

void OptimizerConfig::validate() const {
  const std::string me = std::string("optimizer ") + optimizer_name(kind);
  check_hyper(me, lr, weight_decay, beta1, beta2, eps, momentum);
  STRATA_CHECK(!nesterov || (kind == OptimizerKind::kSgd && momentum > 0 && dampening == 0), me,
               ": nesterov needs SGD with momentum > 0 and dampening 0");
  STRATA_CHECK(std::isfinite(dampening) && dampening >= 0 && dampening <= 1, me, ": dampening must be in [0, 1], got ",
               dampening);
  for (size_t i = 0; i < groups.size(); ++i) {
    const ParamGroup& g = groups[i];
    STRATA_CHECK(!g.name.empty() && g.name != "default", me, ": parameter group ", i,
                 " needs a name of its own (not empty, not \"default\")");
    STRATA_CHECK(g.select != nullptr, me, ": parameter group ", g.name, " has no select function");
    for (size_t j = 0; j < i; ++j) {
      STRATA_CHECK(groups[j].name != g.name, me, ": two parameter groups are named ", g.name);
    }
    check_hyper(me + ", group " + g.name, g.lr, g.weight_decay, g.beta1, g.beta2, g.eps, g.momentum);
    STRATA_CHECK(!nesterov || !g.momentum || *g.momentum > 0, me, ", group ", g.name,
                 ": nesterov needs momentum > 0");
  }
  schedule.validate();
}

}  // namespace strata::parallel
