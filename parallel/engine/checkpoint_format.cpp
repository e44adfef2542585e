#include "checkpoint_format.h"

#include "strata/core/error.h"

namespace strata::parallel {

using json = nlohmann::json;

namespace {

LrSchedule::Kind schedule_kind(const std::string& name) {
  for (LrSchedule::Kind k : {LrSchedule::Kind::kConstant, LrSchedule::Kind::kWarmupCosine,
                             LrSchedule::Kind::kWarmupLinear}) {
    LrSchedule probe;
    probe.kind = k;
    if (name == probe.kind_name()) return k;
  }
  STRATA_FAIL("unknown lr schedule \"", name, "\"");
}

}  // namespace

std::string st_dtype(DType d) {
  switch (d) {
    case DType::kFloat32: return "F32";
    case DType::kBFloat16: return "BF16";
    case DType::kFloat16: return "F16";
  }
  STRATA_FAIL("unknown dtype");
}

std::vector<std::pair<std::string, at::Generator>> generators(const torch::Device& device) {
  std::vector<std::pair<std::string, at::Generator>> g = {{"rng_cpu", at::detail::getDefaultCPUGenerator()}};
  if (device.is_cuda()) g.emplace_back("rng_cuda", at::globalContext().defaultGenerator(device));
  return g;
}

std::string rng_file(const std::string& stem, int rank, int part, int parts) {
  const std::string of_part = parts == 1 ? stem : fmt::format("{}.part{}", stem, part);
  return rank == 0 ? of_part + ".bin" : fmt::format("{}.rank{}.bin", of_part, rank);
}

json optimizer_state(const EngineContext& s, int64_t optimizer_steps) {
  json groups = json::array();
  for (const GroupSettings& g : s.groups) {
    groups.push_back({{"name", g.name}, {"lr", g.lr}, {"weight_decay", g.weight_decay}, {"beta1", g.beta1},
                      {"beta2", g.beta2}, {"eps", g.eps}, {"momentum", g.momentum}});
  }
  const LrSchedule& sch = s.optimizer.schedule;
  return {{"kind", optimizer_name(s.optimizer.kind)},
          {"states", s.optimizer.state_names()},
          {"dampening", s.optimizer.dampening},
          {"nesterov", s.optimizer.nesterov},
          {"groups", groups},
          {"schedule", {{"kind", sch.kind_name()}, {"warmup_steps", sch.warmup_steps}, {"total_steps", sch.total_steps},
                        {"warmup_start_factor", sch.warmup_start_factor}, {"min_lr_ratio", sch.min_lr_ratio}}},
          {"optimizer_steps", optimizer_steps}};
}

SavedState parse_saved_state(const std::string& text, const std::string& path, const EngineContext& s) {
  json st;
  try {
    st = json::parse(text);
  } catch (const json::exception& e) {
    STRATA_FAIL(path, ": not JSON (", e.what(), ")");
  }
  SavedState v;
  checkpoint::StateIndex index = checkpoint::parse_state_index(st, path);  // the layout and the parameters
  v.layout = index.layout;
  v.precision = index.precision;
  v.rng_files = std::move(index.rng_files);
  v.module_state_files = std::move(index.module_state_files);
  for (checkpoint::SavedParam& p : index.params) {
    const std::string name = p.name;
    v.params.emplace(name, std::move(p));
  }
  v.dampening = s.optimizer.dampening;
  v.nesterov = s.optimizer.nesterov;
  try {
    v.grad_accumulation = st.at("grad_accumulation").get<int>();
    v.micro_steps = st.at("micro_steps").get<int>();
    v.loss_scale = st.at("loss_scale").get<double>();
    v.clean_steps = st.at("clean_steps").get<int>();
    v.skipped = st.at("skipped_steps").get<int64_t>();
    if (st.contains("previous_grad_norm")) v.previous_grad_norm = st.at("previous_grad_norm").get<double>();
    if (st.contains("gradient_arrivals")) v.gradient_arrivals = st.at("gradient_arrivals").get<std::vector<int>>();
    if (st.contains("optimizer")) {
      const json& o = st.at("optimizer");
      v.optimizer = o.at("kind").get<std::string>();
      v.states = o.at("states").get<std::vector<std::string>>();
      v.dampening = o.at("dampening").get<double>();
      v.nesterov = o.at("nesterov").get<bool>();
      for (const json& g : o.at("groups")) {
        v.groups.push_back({g.at("name").get<std::string>(), g.at("lr").get<double>(),
                            g.at("weight_decay").get<double>(), g.at("beta1").get<double>(),
                            g.at("beta2").get<double>(), g.at("eps").get<double>(), g.at("momentum").get<double>()});
      }
      const json& sch = o.at("schedule");
      LrSchedule schedule;
      schedule.kind = schedule_kind(sch.at("kind").get<std::string>());
      schedule.warmup_steps = sch.at("warmup_steps").get<int64_t>();
      schedule.total_steps = sch.at("total_steps").get<int64_t>();
      schedule.warmup_start_factor = sch.at("warmup_start_factor").get<double>();
      schedule.min_lr_ratio = sch.at("min_lr_ratio").get<double>();
      schedule.validate();
      v.schedule = schedule;
      v.optimizer_steps = o.at("optimizer_steps").get<int64_t>();
      STRATA_CHECK(v.optimizer_steps >= 0, "negative optimizer_steps");
    }
  } catch (const std::exception& e) {
    STRATA_FAIL(path, ": malformed engine state: ", e.what());
  }
  STRATA_CHECK(v.grad_accumulation >= 1 && v.micro_steps >= 0 && v.loss_scale >= 1.0, path,
               ": out-of-range accumulation, micro-step or loss scale");
  return v;
}

}  // namespace strata::parallel
