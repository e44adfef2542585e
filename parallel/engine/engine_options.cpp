#include "strata/parallel/engine_options.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/memory/eviction_policy.h"

namespace strata::parallel {
namespace {

// Applies `parse` to the variable's value when it is set, naming the variable
// in any error.
template <typename Fn>
void from_env_var(const char* name, Fn parse) {
  const char* v = std::getenv(name);
  if (v == nullptr) return;
  try {
    parse(std::string(v));
  } catch (const Error& e) {
    STRATA_FAIL("environment variable ", name, "=\"", v, "\": ", e.what());
  }
}

double parse_number(const std::string& s) {
  char* end = nullptr;
  errno = 0;
  const double d = std::strtod(s.c_str(), &end);
  STRATA_CHECK(!s.empty() && end == s.c_str() + s.size() && errno == 0 && std::isfinite(d), "\"", s,
               "\" is not a number");
  return d;
}

int64_t parse_integer(const std::string& s) {
  const double d = parse_number(s);
  STRATA_CHECK(d == std::floor(d) && std::fabs(d) < 9e15, "\"", s, "\" is not an integer");
  return static_cast<int64_t>(d);
}

}  // namespace

EngineOptions EngineOptions::from_env(EngineOptions base) {
  EngineOptions o = std::move(base);
  from_env_var("STRATA_DEVICE_BUDGET", [&](const std::string& v) { o.budgets.device = parse_bytes(v); });
  from_env_var("STRATA_HOST_BUDGET", [&](const std::string& v) { o.budgets.host = parse_bytes(v); });
  from_env_var("STRATA_NVME_BUDGET", [&](const std::string& v) { o.budgets.nvme = parse_bytes(v); });
  from_env_var("STRATA_NVME_DIR", [&](const std::string& v) { o.nvme_dir = v; });
  from_env_var("STRATA_PRECISION", [&](const std::string& v) { o.precision = parse_dtype(v); });
  from_env_var("STRATA_CHUNK_ELEMS", [&](const std::string& v) { o.chunk_elems = parse_integer(v); });
  from_env_var("STRATA_CLIP_NORM", [&](const std::string& v) { o.clip_norm = parse_number(v); });
  from_env_var("STRATA_GRAD_ACCUMULATION",
               [&](const std::string& v) { o.grad_accumulation = static_cast<int>(parse_integer(v)); });
  from_env_var("STRATA_NVME_OPTIM_FRACTION", [&](const std::string& v) { o.nvme_optim_fraction = parse_number(v); });
  from_env_var("STRATA_DEVICE_OPTIM_FRACTION", [&](const std::string& v) { o.device_optim_fraction = parse_number(v); });
  o.take_trace_from_env();
  from_env_var("STRATA_DEVICE_CAPACITY", [&](const std::string& v) { o.device_capacity = parse_bytes(v); });
  from_env_var("STRATA_PREFETCH", [&](const std::string& v) {
    STRATA_CHECK(v == "0" || v == "1", "\"", v, "\" is not 0 or 1");
    o.prefetch = v == "1";
  });
  from_env_var("STRATA_UPDATE_IN_BACKWARD", [&](const std::string& v) {
    STRATA_CHECK(v == "0" || v == "1", "\"", v, "\" is not 0 or 1");
    o.update_in_backward = v == "1";
  });
  from_env_var("STRATA_POLICY", [&](const std::string& v) { o.policy = v; });
  from_env_var("STRATA_STATIC_PARAM_FRACTION",
               [&](const std::string& v) { o.static_param_fraction = parse_number(v); });
  from_env_var("STRATA_ZERO_STAGE", [&](const std::string& v) { o.zero_stage = static_cast<int>(parse_integer(v)); });
  from_env_var("STRATA_INIT_WEIGHTS", [&](const std::string& v) { o.init_weights = v; });
  from_env_var("STRATA_INIT_WEIGHTS_NAMES", [&](const std::string& v) { o.init_weights_names = v; });
  from_env_var("STRATA_LOSS_SCALE", [&](const std::string& v) { o.loss_scale.initial = parse_number(v); });
  o.validate();
  return o;
}

void EngineOptions::take_trace_from_env() {
  from_env_var("STRATA_TRACE", [&](const std::string& v) { trace_path = v; });
  from_env_var("STRATA_TRACE_STEPS", [&](const std::string& v) { trace_steps = static_cast<int>(parse_integer(v)); });
}

void EngineOptions::validate() const {
  STRATA_CHECK(budgets.device > 0, "the device budget is 0; give the device tier a budget (device_budget, "
               "STRATA_DEVICE_BUDGET)");
  STRATA_CHECK(budgets.host > 0, "the host budget is 0; the optimizer step runs on host: give it a budget "
               "(host_budget, STRATA_HOST_BUDGET)");
  STRATA_CHECK(budgets.nvme == 0 || !nvme_dir.empty(), "an nvme budget of ", format_bytes(budgets.nvme),
               " needs a directory for its files (nvme_dir, STRATA_NVME_DIR)");
  STRATA_CHECK(chunk_elems >= 0, "chunk_elems is ", chunk_elems, "; give a positive size, or 0 for auto");
  STRATA_CHECK(clip_norm >= 0, "clip_norm is ", clip_norm, "; give a positive norm, or 0 for no clipping");
  STRATA_CHECK(!update_in_backward || precision != DType::kFloat16, "update_in_backward cannot run with fp16: the "
               "loss scaler skips a step when any gradient overflows, which is known only after every family's "
               "gradients exist; use bf16, or set update_in_backward false");
  STRATA_CHECK(grad_accumulation >= 1, "gradient accumulation steps must be at least 1, got ", grad_accumulation);
  STRATA_CHECK(device_optim_fraction >= 0.0 && device_optim_fraction <= 1.0, "device_optim_fraction is ",
               device_optim_fraction, "; give the fraction of chunk families updated on the device, in [0, 1]");
  STRATA_CHECK(nvme_optim_fraction == -1.0 || (nvme_optim_fraction >= 0.0 && nvme_optim_fraction <= 1.0),
               "nvme_optim_fraction is ", nvme_optim_fraction, "; give a fraction in [0, 1], or -1 for auto");
  STRATA_CHECK(nvme_optim_fraction <= 0.0 || budgets.nvme > 0, "nvme_optim_fraction is ", nvme_optim_fraction,
               " but there is no nvme tier; give it a budget (nvme_budget, STRATA_NVME_BUDGET)");
  STRATA_CHECK(device_safety_ratio > 0.0 && device_safety_ratio <= 1.0, "device_safety_ratio is ",
               device_safety_ratio, "; give a fraction in (0, 1]");
  memory::parse_policy(policy);  // throws naming the policies there are
  STRATA_CHECK(static_param_fraction == -1.0 || (static_param_fraction >= 0.0 && static_param_fraction <= 1.0),
               "static_param_fraction is ", static_param_fraction, "; give a fraction in [0, 1], or -1 for auto");
  STRATA_CHECK(zero_stage >= 0 && zero_stage <= 3, "zero_stage is ", zero_stage, "; give 0 (data parallel), 1 "
               "(shard optimizer state), 2 (and gradients) or 3 (and parameters)");
  STRATA_CHECK(trace_steps >= 1, "trace_steps is ", trace_steps, "; trace at least one step");
  STRATA_CHECK(loss_scale.initial >= 1.0 && loss_scale.min_scale >= 1.0 && loss_scale.min_scale <= loss_scale.initial,
               "the loss scale must be at least 1 and min_scale at most the initial scale; got initial ",
               loss_scale.initial, ", min_scale ", loss_scale.min_scale);
  STRATA_CHECK(loss_scale.backoff > 0.0 && loss_scale.backoff < 1.0 && loss_scale.growth_factor > 1.0 &&
                   loss_scale.growth_interval >= 1,
               "loss scaling needs 0 < backoff < 1, growth_factor > 1 and growth_interval >= 1");
}

int64_t model_state_bytes_per_param(DType precision, int optimizer_states) {
  const int64_t compute = static_cast<int64_t>(dtype_size(precision));
  const int64_t master = precision == DType::kFloat32 ? 0 : 4;
  return 2 * compute + master + 4 * optimizer_states;
}

}  // namespace strata::parallel
