// HybridPlan: parsing (JSON, environment), printing and validation. No
// collective runs here: validated() is what every rank can check alone.
#include "strata/parallel/plan.h"

#include <fmt/format.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "strata/core/error.h"
#include "strata/parallel/rendezvous.h"

namespace strata::parallel {

namespace {

using Json = nlohmann::json;

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t") - a + 1);
}

int64_t parse_count(const std::string& text, const std::string& key, const std::string& style) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  STRATA_CHECK(!text.empty() && *end == '\0' && v >= 0 && v < (1LL << 30), "style \"", style, "\": ", key,
               " takes a non-negative integer, not \"", text, "\"");
  return v;
}

// The keys an object may hold; anything else is a typo the user must hear of.
void only_keys(const Json& j, const std::string& where, std::initializer_list<const char*> keys) {
  STRATA_CHECK(j.is_object(), where, " must be a JSON object, not ", j.dump());
  for (const auto& item : j.items()) {
    bool known = false;
    std::string list;
    for (const char* k : keys) {
      known = known || item.key() == k;
      list += list.empty() ? k : std::string(", ") + k;
    }
    STRATA_CHECK(known, where, " has an unknown key \"", item.key(), "\"; the keys are ", list);
  }
}

template <typename T>
T get(const Json& j, const char* key, const std::string& where, T fallback) {
  if (!j.contains(key)) return fallback;
  try {
    return j.at(key).get<T>();
  } catch (const Json::exception&) {
    STRATA_FAIL(where, ": \"", key, "\" is ", j.at(key).dump(), ", which is not a ",
                std::is_same_v<T, bool> ? "true or false" : std::is_integral_v<T> ? "whole number" : std::is_same_v<T, std::string> ? "string" : "number");
  }
}

}  // namespace

ParallelStyle parse_style(const std::string& text) {
  const std::string t = trim(text);
  const size_t open = t.find('(');
  const std::string kind = trim(t.substr(0, open));
  std::vector<std::string> args;
  if (open != std::string::npos) {
    STRATA_CHECK(t.back() == ')', "style \"", text, "\" opens a parenthesis it does not close");
    std::stringstream in(t.substr(open + 1, t.size() - open - 2));
    for (std::string a; std::getline(in, a, ',');) {
      if (!trim(a).empty()) args.push_back(trim(a));
    }
  }
  ParallelStyle s;
  if (kind == "columnwise") {
    s = ParallelStyle::columnwise();
  } else if (kind == "rowwise") {
    s = ParallelStyle::rowwise();
  } else if (kind == "vocab_embedding") {
    s = ParallelStyle::vocab_embedding();
  } else if (kind == "replicated") {
    s = ParallelStyle::replicated();
  } else if (kind == "sequence_shard") {
    s = ParallelStyle::sequence_shard(0);
  } else {
    STRATA_FAIL("unknown style \"", text,
                "\"; choose columnwise, rowwise, vocab_embedding, replicated or sequence_shard, with options in "
                "parentheses: columnwise(fused=3, gather), rowwise(sequence=1), sequence_shard(dim=0)");
  }
  for (const std::string& a : args) {
    const size_t eq = a.find('=');
    const std::string key = trim(a.substr(0, eq));
    const std::string value = eq == std::string::npos ? "" : trim(a.substr(eq + 1));
    const bool splits = kind == "columnwise" || kind == "rowwise" || kind == "vocab_embedding";
    if (kind == "columnwise" && key == "fused") {
      s.fused = static_cast<int>(parse_count(value, key, text));
      STRATA_CHECK(s.fused >= 1, "style \"", text, "\": fused must be at least 1");
    } else if (kind == "columnwise" && key == "gather" && eq == std::string::npos) {
      s.gather_output = true;
    } else if (kind == "vocab_embedding" && key == "untied" && eq == std::string::npos) {
      s.gather_output = false;
    } else if (splits && key == "sequence") {
      s = s.along_sequence(parse_count(value, key, text));
    } else if (kind == "sequence_shard" && key == "dim") {
      s.sequence_dim = parse_count(value, key, text);
    } else {
      STRATA_FAIL("style \"", text, "\": ", kind, " takes no option \"", a, "\" (columnwise: fused=N, gather, "
                  "sequence=D; rowwise: sequence=D; vocab_embedding: untied, sequence=D; sequence_shard: dim=D)");
    }
  }
  return s;
}

std::string style_name(const ParallelStyle& s) {
  std::vector<std::string> opts;
  std::string kind;
  switch (s.kind) {
    case ParallelStyle::Kind::kColumnwise:
      kind = "columnwise";
      if (s.fused != 1) opts.push_back(fmt::format("fused={}", s.fused));
      if (s.gather_output) opts.push_back("gather");
      break;
    case ParallelStyle::Kind::kRowwise: kind = "rowwise"; break;
    case ParallelStyle::Kind::kVocabEmbedding:
      kind = "vocab_embedding";
      if (!s.gather_output) opts.push_back("untied");
      break;
    case ParallelStyle::Kind::kReplicated: kind = "replicated"; break;
    case ParallelStyle::Kind::kSequenceShard: return fmt::format("sequence_shard(dim={})", s.sequence_dim);
  }
  if (s.sequence_parallel) opts.push_back(fmt::format("sequence={}", s.sequence_dim));
  if (opts.empty()) return kind;
  return fmt::format("{}({})", kind, fmt::join(opts, ", "));
}

HybridPlan HybridPlan::from_json(const std::string& text, const std::string& origin) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::parse_error& e) {
    STRATA_FAIL(origin, " is not valid JSON: ", e.what());
  }
  only_keys(j, origin, {"dp", "zero_stage", "pipeline", "tensor", "sequence"});
  HybridPlan p;
  p.dp = get<int>(j, "dp", origin, 0);
  p.zero_stage = get<int>(j, "zero_stage", origin, 0);
  if (j.contains("pipeline")) {
    const Json& q = j.at("pipeline");
    const std::string where = origin + "'s \"pipeline\"";
    only_keys(q, where, {"size", "schedule", "microbatches", "virtual_stages", "boundaries", "trace", "memory_weight"});
    p.pp.size = get<int>(q, "size", where, 1);
    if (q.contains("schedule")) p.pp.schedule = pipeline::schedule_from_name(get<std::string>(q, "schedule", where, ""));
    p.pp.microbatches = get<int>(q, "microbatches", where, 0);
    p.pp.virtual_stages = get<int>(q, "virtual_stages", where, 1);
    p.pp.boundaries = get<std::vector<int>>(q, "boundaries", where, {});
    p.pp.trace = get<std::string>(q, "trace", where, "");
    p.pp.memory_weight = get<double>(q, "memory_weight", where, 0.5);
  }
  if (j.contains("tensor")) {
    const Json& t = j.at("tensor");
    const std::string where = origin + "'s \"tensor\"";
    only_keys(t, where, {"size", "mode", "depth", "sequence_parallel", "layers"});
    p.tp.size = get<int>(t, "size", where, 1);
    if (t.contains("mode")) p.tp.mode = parse_tensor_mode(get<std::string>(t, "mode", where, ""));
    p.tp.depth = get<int>(t, "depth", where, 1);
    p.tp.sequence_parallel = get<bool>(t, "sequence_parallel", where, false);
    if (t.contains("layers")) {
      const Json& layers = t.at("layers");
      // [["pattern", "style"], ...] keeps the order; {"pattern": "style"} is accepted too.
      if (layers.is_object()) {
        for (const auto& item : layers.items()) {
          STRATA_CHECK(item.value().is_string(), where, "'s layer \"", item.key(), "\" needs a style string");
          p.tp.layers.emplace_back(item.key(), parse_style(item.value().get<std::string>()));
        }
      } else {
        STRATA_CHECK(layers.is_array(), where, "'s \"layers\" must be [[pattern, style], ...]");
        for (const Json& e : layers) {
          STRATA_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(), where,
                       "'s \"layers\" entry ", e.dump(), " is not a [pattern, style] pair of strings");
          p.tp.layers.emplace_back(e[0].get<std::string>(), parse_style(e[1].get<std::string>()));
        }
      }
    }
  }
  if (j.contains("sequence")) {
    const Json& s = j.at("sequence");
    const std::string where = origin + "'s \"sequence\"";
    only_keys(s, where, {"size", "mode", "dim"});
    p.sp.size = get<int>(s, "size", where, 1);
    if (s.contains("mode")) p.sp.mode = sequence::parse_mode(get<std::string>(s, "mode", where, ""));
    p.sp.dim = get<int64_t>(s, "dim", where, 1);
  }
  return p;
}

HybridPlan HybridPlan::from_file(const std::string& path) {
  std::ifstream in(path);
  STRATA_CHECK(in.good(), "cannot read the plan file ", path, ": it is missing or unreadable");
  std::stringstream text;
  text << in.rdbuf();
  STRATA_CHECK(!in.bad(), "reading the plan file ", path, " failed");
  return from_json(text.str(), "the plan file " + path);
}

HybridPlan HybridPlan::from_env(HybridPlan base) {
  HybridPlan p = std::move(base);
  if (const char* f = std::getenv("STRATA_PLAN"); f != nullptr && *f != '\0') {
    HybridPlan file = from_file(f);
    if (file.tp.layers.empty()) file.tp.layers = std::move(p.tp.layers);  // the file's layers, else the base's
    p = std::move(file);
  }
  const auto text = [](const char* name) -> const char* {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  };
  p.dp = env_int("STRATA_DP", p.dp);
  p.zero_stage = env_int("STRATA_ZERO_STAGE", p.zero_stage);
  p.pp.size = env_int("STRATA_PP", p.pp.size);
  if (const char* s = text("STRATA_PP_SCHEDULE")) p.pp.schedule = pipeline::schedule_from_name(s);
  p.pp.microbatches = env_int("STRATA_MICROBATCHES", p.pp.microbatches);
  p.pp.virtual_stages = env_int("STRATA_VIRTUAL_STAGES", p.pp.virtual_stages);
  p.tp.size = env_int("STRATA_TP", p.tp.size);
  if (const char* s = text("STRATA_TP_MODE")) p.tp.mode = parse_tensor_mode(s);
  p.tp.depth = env_int("STRATA_TP_DEPTH", p.tp.depth);
  p.tp.sequence_parallel = env_int("STRATA_TP_SEQUENCE_PARALLEL", p.tp.sequence_parallel ? 1 : 0) != 0;
  p.sp.size = env_int("STRATA_SP", p.sp.size);
  if (const char* s = text("STRATA_SP_MODE")) p.sp.mode = sequence::parse_mode(s);
  return p;
}

HybridPlan HybridPlan::from_env() { return from_env(HybridPlan()); }

std::string HybridPlan::to_json() const {
  Json layers = Json::array();
  for (const auto& [pattern, style] : tp.layers) layers.push_back({pattern, style_name(style)});
  Json pipe = {{"size", pp.size},
               {"schedule", pipeline::schedule_name(pp.schedule)},
               {"microbatches", pp.microbatches},
               {"virtual_stages", pp.virtual_stages}};
  if (!pp.boundaries.empty()) pipe["boundaries"] = pp.boundaries;
  if (!pp.trace.empty()) {
    pipe["trace"] = pp.trace;
    pipe["memory_weight"] = pp.memory_weight;
  }
  const Json j = {{"dp", dp},
                  {"zero_stage", zero_stage},
                  {"pipeline", pipe},
                  {"tensor",
                   {{"size", tp.size},
                    {"mode", tensor_mode_name(tp.mode)},
                    {"depth", tp.depth},
                    {"sequence_parallel", tp.sequence_parallel},
                    {"layers", layers}}},
                  {"sequence", {{"size", sp.size}, {"mode", sequence::mode_name(sp.mode)}, {"dim", sp.dim}}}};
  return j.dump(2);
}

HybridPlan HybridPlan::validated(int world_size, const ModelShape& shape) const {
  HybridPlan p = *this;
  STRATA_CHECK(p.pp.size >= 1 && p.tp.size >= 1 && p.sp.size >= 1 && p.dp >= 0, "plan sizes must be at least 1 (dp 0: "
               "the ranks left), got dp ", p.dp, ", pp ", p.pp.size, ", tp ", p.tp.size, ", sp ", p.sp.size);
  const int model_ranks = p.pp.size * p.tp.size * p.sp.size;
  if (p.dp == 0) {
    STRATA_CHECK(world_size % model_ranks == 0, "pp ", p.pp.size, " x tp ", p.tp.size, " x sp ", p.sp.size, " = ",
                 model_ranks, " ranks do not divide the world's ", world_size,
                 ": run a multiple of ", model_ranks, " ranks (strata run -n), or change the sizes");
    p.dp = world_size / model_ranks;
  }
  STRATA_CHECK(p.world_size() == world_size, "the plan ", p.describe(), " needs ", p.world_size(),
               " ranks, but the world has ", world_size, ": change dp (or leave it 0 for the ranks left) or run ",
               p.world_size(), " ranks");
  STRATA_CHECK(p.zero_stage >= 0 && p.zero_stage <= 3, "zero_stage is ", p.zero_stage, "; choose 0, 1, 2 or 3");
  // The pipeline.
  if (p.pp.microbatches == 0) p.pp.microbatches = 2 * p.pp.size;
  if (p.pp.size > 1 || p.pp.virtual_stages > 1) {
    pipeline::check_schedule(p.pp.schedule, p.pp.size, p.pp.virtual_stages, p.pp.microbatches);
  }
  const int64_t stages = static_cast<int64_t>(p.pp.size) * p.pp.virtual_stages;
  if (!p.pp.boundaries.empty()) {
    STRATA_CHECK(static_cast<int64_t>(p.pp.boundaries.size()) == stages + 1, "the plan's pipeline boundaries give ",
                 p.pp.boundaries.size(), " layer indices; ", stages, " stages (size x virtual_stages) need ", stages + 1);
    STRATA_CHECK(p.pp.trace.empty(), "the plan gives both pipeline boundaries and a trace to cut by; keep one");
  }
  STRATA_CHECK(shape.layers == 0 || shape.layers >= stages, "the model has ", shape.layers, " layers, fewer than the ",
               stages, " pipeline stages (size x virtual_stages): lower the pipeline size or virtual_stages");
  STRATA_CHECK(p.pp.memory_weight >= 0.0 && p.pp.memory_weight <= 1.0, "the pipeline's memory_weight is ",
               p.pp.memory_weight, "; it must be within 0 and 1");
  // Tensor parallelism.
  const int q = tensor_grid_side(p.tp.mode, p.tp.size, p.tp.depth);
  switch (p.tp.mode) {
    case TensorMode::k1D:
      STRATA_CHECK(p.tp.depth == 1, "tensor depth ", p.tp.depth, " belongs to mode 2.5d; mode 1d has none");
      STRATA_CHECK(shape.heads == 0 || shape.heads % p.tp.size == 0, "tp ", p.tp.size, " (1d) splits the model's ",
                   shape.heads, " attention heads: choose a tp that divides them");
      STRATA_CHECK(shape.hidden == 0 || shape.hidden % p.tp.size == 0, "tp ", p.tp.size, " (1d) does not divide the hidden size ",
                   shape.hidden);
      break;
    case TensorMode::k2D:
      STRATA_CHECK(p.tp.depth == 1, "tensor depth ", p.tp.depth, " belongs to mode 2.5d; 2d is one q x q grid");
      STRATA_CHECK(q > 0, "tp ", p.tp.size, " in mode 2d must be a square (q x q: 4, 9, 16, ..)");
      break;
    case TensorMode::k2_5D:
      STRATA_CHECK(q > 0, "tp ", p.tp.size, " in mode 2.5d must be q x q x depth (depth ", p.tp.depth,
                   "): e.g. 8 with depth 2");
      break;
    case TensorMode::k3D:
      STRATA_CHECK(p.tp.depth == 1, "tensor depth ", p.tp.depth, " belongs to mode 2.5d; 3d is a d x d x d cube");
      STRATA_CHECK(q > 0, "tp ", p.tp.size, " in mode 3d must be a cube (d x d x d: 8, 27, ..)");
      break;
  }
  if (p.tp.mode != TensorMode::k1D) {
    STRATA_CHECK(shape.hidden == 0 || shape.hidden % q == 0, "tp ", p.tp.size, " (", tensor_mode_name(p.tp.mode),
                 ") splits the hidden size ", shape.hidden, " into ", q, " blocks: choose a size it divides");
    STRATA_CHECK(shape.heads == 0 || shape.heads % q == 0, "tp ", p.tp.size, " (", tensor_mode_name(p.tp.mode),
                 ") splits the model's ", shape.heads, " attention heads into ", q, " feature blocks: choose a size "
                 "whose grid side divides them");
    for (const auto& [pattern, style] : p.tp.layers) {
      STRATA_CHECK(style.kind != ParallelStyle::Kind::kReplicated && style.kind != ParallelStyle::Kind::kSequenceShard,
                   "the plan's tensor layers give \"", pattern, "\" the style ", style_name(style), "; in mode ",
                   tensor_mode_name(p.tp.mode), " every activation is split, so no layer stays whole: name linear "
                   "layers columnwise or rowwise and the input embedding vocab_embedding");
    }
    STRATA_CHECK(p.sp.size == 1, "sp ", p.sp.size, " with tensor mode ", tensor_mode_name(p.tp.mode), ": sequence "
                 "parallelism goes with tensor mode 1d; set the tensor mode to 1d, or sp to 1");
  }
  bool shards_sequence = false;
  for (const auto& [pattern, style] : p.tp.layers) shards_sequence = shards_sequence || style.sequence_parallel;
  if (p.tp.sequence_parallel) {
    STRATA_CHECK(p.tp.mode == TensorMode::k1D && p.tp.size > 1, "Megatron's sequence parallelism "
                 "(tensor.sequence_parallel) goes with tensor parallelism in mode 1d of size above 1");
    STRATA_CHECK(shards_sequence, "tensor.sequence_parallel is set, but no style of the plan's layers shards along the "
                 "sequence: give the styles along_sequence (\"columnwise(sequence=1)\", \"rowwise(sequence=1)\") and "
                 "sequence_shard to the norms");
    STRATA_CHECK(shape.context == 0 || shape.context % (p.tp.size * p.sp.size) == 0, "Megatron's sequence "
                 "parallelism splits each sequence's ", shape.context, " positions over tp ", p.tp.size,
                 p.sp.size > 1 ? fmt::format(" within each of sp {}'s shards", p.sp.size) : std::string(),
                 ": choose a context it divides");
  } else {
    STRATA_CHECK(!shards_sequence, "the plan's layers shard activations along the sequence (sequence=), but "
                 "tensor.sequence_parallel is not set: set it, or drop the sequence= options");
  }
  // Sequence parallelism.
  STRATA_CHECK(p.sp.dim >= 0, "the sequence dimension must be non-negative, not ", p.sp.dim);
  if (p.sp.size > 1) {
    const int parts = p.sp.mode == sequence::Mode::kRingAttention ? 2 * p.sp.size : p.sp.size;
    STRATA_CHECK(shape.context == 0 || shape.context % parts == 0, "sp ", p.sp.size, " (",
                 sequence::mode_name(p.sp.mode), ") splits each sequence's ", shape.context, " positions into ", parts,
                 " equal parts", p.sp.mode == sequence::Mode::kRingAttention ? " (the zigzag layout: 2 per rank)" : "",
                 ": choose a context it divides");
    if (p.sp.mode == sequence::Mode::kUlysses && shape.heads > 0) {
      const int64_t local_heads = p.tp.mode == TensorMode::k1D ? shape.heads / p.tp.size : shape.heads;
      STRATA_CHECK(local_heads % p.sp.size == 0, "Ulysses attention splits each rank's ", local_heads,
                   " heads (", shape.heads, p.tp.size > 1 ? fmt::format(" over tp {}", p.tp.size) : std::string(),
                   ") over sp ", p.sp.size, ": choose sizes that divide them, or ring-attention");
    }
  }
  return p;
}

std::string HybridPlan::describe() const {
  std::string s = fmt::format("dp {}", dp);
  if (zero_stage > 0) s += fmt::format(" (ZeRO {})", zero_stage);
  s += fmt::format(" x pp {}", pp.size);
  if (pp.size > 1) {
    s += fmt::format(" ({}, {} microbatches{})", pipeline::schedule_name(pp.schedule), pp.microbatches,
                     pp.virtual_stages > 1 ? fmt::format(", {} virtual", pp.virtual_stages) : std::string());
  }
  s += fmt::format(" x tp {}", tp.size);
  if (tp.size > 1) {
    s += fmt::format(" ({}{})", tensor_mode_name(tp.mode), tp.sequence_parallel ? ", sequence parallel" : "");
  }
  s += fmt::format(" x sp {}", sp.size);
  if (sp.size > 1) s += fmt::format(" ({})", sequence::mode_name(sp.mode));
  return s;
}

}  // namespace strata::parallel
