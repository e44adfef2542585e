// HybridPlan: the config file's JSON and the environment read into the same
// plan, printed back, and every refusal of validated() with the change it
// asks for. validated() runs before any communicator exists.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "../error_of.h"
#include "strata/parallel/plan.h"

namespace strata::parallel {
namespace {

// `text` holds `part`; the whole text is printed when it does not.
#define EXPECT_HAS(text, part)                                      \
  do {                                                              \
    const std::string t_ = (text);                                  \
    EXPECT_NE(t_.find(part), std::string::npos) << "got: " << t_;   \
  } while (0)

TEST(HybridPlan, ReadsTheConfigFile) {
  const HybridPlan p = HybridPlan::from_json(R"j({
    "dp": 2, "zero_stage": 3,
    "pipeline": {"size": 2, "schedule": "interleaved-1f1b", "microbatches": 4, "virtual_stages": 2},
    "tensor": {"size": 2, "mode": "1d", "sequence_parallel": true,
               "layers": [["blocks.*.qkv", "columnwise(fused=3, sequence=1)"], ["blocks.*.proj", "rowwise(sequence=1)"],
                          ["tok", "vocab_embedding(untied)"], ["ln", "sequence_shard(dim=0)"]]},
    "sequence": {"size": 2, "mode": "ulysses"}})j");
  EXPECT_EQ(p.dp, 2);
  EXPECT_EQ(p.zero_stage, 3);
  EXPECT_EQ(p.pp.size, 2);
  EXPECT_EQ(p.pp.schedule, pipeline::Schedule::kInterleaved1F1B);
  EXPECT_EQ(p.pp.microbatches, 4);
  EXPECT_EQ(p.pp.virtual_stages, 2);
  EXPECT_EQ(p.tp.size, 2);
  EXPECT_TRUE(p.tp.sequence_parallel);
  ASSERT_EQ(p.tp.layers.size(), 4u);
  EXPECT_EQ(p.tp.layers[0].first, "blocks.*.qkv");
  EXPECT_EQ(p.tp.layers[0].second.kind, ParallelStyle::Kind::kColumnwise);
  EXPECT_EQ(p.tp.layers[0].second.fused, 3);
  EXPECT_TRUE(p.tp.layers[0].second.sequence_parallel);
  EXPECT_EQ(p.tp.layers[0].second.sequence_dim, 1);
  EXPECT_EQ(p.tp.layers[2].second.kind, ParallelStyle::Kind::kVocabEmbedding);
  EXPECT_FALSE(p.tp.layers[2].second.gather_output);
  EXPECT_EQ(p.tp.layers[3].second.kind, ParallelStyle::Kind::kSequenceShard);
  EXPECT_EQ(p.tp.layers[3].second.sequence_dim, 0);
  EXPECT_EQ(p.sp.size, 2);
  EXPECT_EQ(p.sp.mode, sequence::Mode::kUlysses);
  // Printed and read back: the same plan.
  const HybridPlan q = HybridPlan::from_json(p.to_json());
  EXPECT_EQ(q.to_json(), p.to_json());
  EXPECT_EQ(p.validated(16).describe(),
            "dp 2 (ZeRO 3) x pp 2 (interleaved-1f1b, 4 microbatches, 2 virtual) x tp 2 (1d, sequence parallel) x sp 2 "
            "(ulysses)");
}

TEST(HybridPlan, StylesReadAsParallelizeWritesThem) {
  for (const char* text : {"columnwise", "columnwise(fused=3)", "columnwise(gather)", "columnwise(fused=2, gather, sequence=1)",
                           "rowwise", "rowwise(sequence=1)", "vocab_embedding", "vocab_embedding(untied, sequence=1)",
                           "replicated", "sequence_shard(dim=0)", "sequence_shard(dim=1)"}) {
    EXPECT_EQ(style_name(parse_style(text)), text);
  }
  EXPECT_HAS(error_of([] { parse_style("colwise"); }), "unknown style \"colwise\"; choose columnwise");
  EXPECT_HAS(error_of([] { parse_style("rowwise(fused=3)"); }), "rowwise takes no option \"fused=3\"");
  EXPECT_HAS(error_of([] { parse_style("columnwise(fused=x)"); }), "fused takes a non-negative integer");
  EXPECT_HAS(error_of([] { parse_style("columnwise(fused=3"); }), "does not close");
}

TEST(HybridPlan, RefusesWhatTheConfigFileCannotMean) {
  EXPECT_HAS(error_of([] { HybridPlan::from_json("{\"dp\": 2,"); }), "the plan is not valid JSON");
  EXPECT_HAS(error_of([] { HybridPlan::from_json(R"j({"pipline": {"size": 2}})j"); }), "the plan has an unknown key \"pipline\"; the keys are dp, zero_stage, pipeline, tensor, sequence");
  EXPECT_HAS(error_of([] { HybridPlan::from_json(R"j({"tensor": {"size": "two"}})j"); }), "\"size\" is \"two\", which is not a whole number");
  EXPECT_HAS(error_of([] { HybridPlan::from_json(R"j({"tensor": {"mode": "4d"}})j"); }), "unknown tensor-parallel mode \"4d\"; choose 1d, 2d, 2.5d or 3d");
  EXPECT_HAS(error_of([] { HybridPlan::from_json(R"j({"sequence": {"mode": "flash"}})j"); }), "unknown sequence-parallel mode \"flash\"");
  EXPECT_HAS(error_of([] { HybridPlan::from_json(R"j({"pipeline": {"schedule": "2f2b"}})j"); }), "2f2b");
  EXPECT_HAS(error_of([] { HybridPlan::from_json(R"j({"tensor": {"layers": [["qkv"]]}})j"); }), "is not a [pattern, style] pair");
  EXPECT_HAS(error_of([] { HybridPlan::from_file("/nonexistent/plan.json"); }), "cannot read the plan file /nonexistent/plan.json: it is missing");
}

TEST(HybridPlan, EnvironmentOverridesTheFile) {
  const std::filesystem::path file = std::filesystem::temp_directory_path() / "strata-plan-test.json";
  {
    std::ofstream out(file);
    out << R"j({"dp": 2, "pipeline": {"size": 2, "schedule": "gpipe"}, "tensor": {"size": 2}})j";
  }
  HybridPlan base;
  base.tp.layers = {{"fc", ParallelStyle::columnwise()}};
  ::setenv("STRATA_PLAN", file.c_str(), 1);
  ::setenv("STRATA_PP_SCHEDULE", "zb-h1", 1);
  ::setenv("STRATA_SP", "2", 1);
  ::setenv("STRATA_ZERO_STAGE", "2", 1);
  const HybridPlan p = HybridPlan::from_env(base);
  ::unsetenv("STRATA_PLAN");
  ::unsetenv("STRATA_PP_SCHEDULE");
  ::unsetenv("STRATA_SP");
  ::unsetenv("STRATA_ZERO_STAGE");
  std::filesystem::remove(file);
  EXPECT_EQ(p.dp, 2);
  EXPECT_EQ(p.pp.size, 2);
  EXPECT_EQ(p.pp.schedule, pipeline::Schedule::kZeroBubbleH1);
  EXPECT_EQ(p.tp.size, 2);
  ASSERT_EQ(p.tp.layers.size(), 1u);  // the file gives none: the base's
  EXPECT_EQ(p.sp.size, 2);
  EXPECT_EQ(p.zero_stage, 2);
  ::setenv("STRATA_TP", "x", 1);
  EXPECT_HAS(error_of([] { HybridPlan::from_env(); }), "STRATA_TP=\"x\" is not a non-negative integer");
  ::unsetenv("STRATA_TP");
}

HybridPlan with(const std::function<void(HybridPlan&)>& f) {
  HybridPlan p;
  f(p);
  return p;
}

TEST(HybridPlan, ValidatedFillsWhatIsLeft) {
  const HybridPlan p = with([](HybridPlan& p) {
    p.pp.size = 2;
    p.tp.size = 2;
  }).validated(8);
  EXPECT_EQ(p.dp, 2);
  EXPECT_EQ(p.pp.microbatches, 4);
  EXPECT_EQ(p.world_size(), 8);
  EXPECT_EQ(p.dims(), (std::array<int, 4>{2, 2, 2, 1}));
}

TEST(HybridPlan, EveryRefusalSaysWhatToChange) {
  ModelShape gpt;
  gpt.hidden = 96;
  gpt.heads = 6;
  gpt.context = 30;
  gpt.layers = 3;
  const auto refusal = [&](const std::function<void(HybridPlan&)>& f, int world, const ModelShape& shape = {}) {
    return error_of([&] { with(f).validated(world, shape); });
  };
  EXPECT_HAS(refusal([](HybridPlan& p) { p.tp.size = 3; }, 8), "= 3 ranks do not divide the world's 8");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.dp = 2; p.tp.size = 2; }, 8), "needs 4 ranks, but the world has 8: change dp");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.pp.size = 0; }, 8), "plan sizes must be at least 1");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.zero_stage = 4; }, 1), "zero_stage is 4; choose 0, 1, 2 or 3");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.tp.size = 4; }, 4, gpt), "tp 4 (1d) splits the model's 6 attention heads");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.tp.size = 2; p.tp.mode = TensorMode::k2D; }, 2), "tp 2 in mode 2d must be a square");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.tp.size = 4; p.tp.mode = TensorMode::k2D; }, 4, [] {
                ModelShape s;
                s.hidden = 15;
                return s;
              }()), "(2d) splits the hidden size 15 into 2 blocks");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.tp.size = 8; p.tp.mode = TensorMode::k2_5D; p.tp.depth = 3; }, 8), "in mode 2.5d must be q x q x depth");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.tp.size = 4; p.tp.mode = TensorMode::k3D; }, 4), "tp 4 in mode 3d must be a cube");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.tp.depth = 2; }, 1), "tensor depth 2 belongs to mode 2.5d");
  EXPECT_HAS(refusal([](HybridPlan& p) {
                p.tp.size = 4;
                p.tp.mode = TensorMode::k2D;
                p.tp.layers = {{"fc", ParallelStyle::columnwise()}, {"ln", ParallelStyle::sequence_shard()}};
              }, 4), "give \"ln\" the style sequence_shard(dim=0); in mode 2d every activation is split");
  EXPECT_HAS(refusal([](HybridPlan& p) {
                p.tp.size = 8;
                p.tp.mode = TensorMode::k3D;
                p.tp.layers = {{"fc", ParallelStyle::replicated()}};
              }, 8), "give \"fc\" the style replicated; in mode 3d");
  EXPECT_HAS(refusal([](HybridPlan& p) {
                p.tp.size = 4;
                p.tp.mode = TensorMode::k2D;
                p.sp.size = 2;
                p.tp.layers = {{"fc", ParallelStyle::columnwise()}};
              }, 8), "sp 2 with tensor mode 2d: sequence parallelism goes with tensor mode 1d");
  EXPECT_HAS(refusal([](HybridPlan& p) {
                p.tp.size = 9;
                p.tp.mode = TensorMode::k2D;
              }, 9, [] {
                ModelShape s;
                s.heads = 4;
                return s;
              }()), "(2d) splits the model's 4 attention heads into 3 feature blocks");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.tp.sequence_parallel = true; }, 1), "goes with tensor parallelism in mode 1d of size above 1");
  EXPECT_HAS(refusal([](HybridPlan& p) {
                p.tp.size = 2;
                p.tp.sequence_parallel = true;
                p.tp.layers = {{"fc", ParallelStyle::columnwise()}};
              }, 2), "no style of the plan's layers shards along the sequence");
  EXPECT_HAS(refusal([](HybridPlan& p) {
                p.tp.size = 2;
                p.tp.layers = {{"fc", ParallelStyle::columnwise().along_sequence(1)}};
              }, 2), "tensor.sequence_parallel is not set");
  EXPECT_HAS(refusal([](HybridPlan& p) {
                p.tp.size = 4;
                p.tp.sequence_parallel = true;
                p.tp.layers = {{"fc", ParallelStyle::columnwise().along_sequence(1)}};
              }, 4, [] {
                ModelShape s;
                s.context = 6;
                return s;
              }()), "splits each sequence's 6 positions over tp 4");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.sp.size = 4; }, 4, gpt),
             "sp 4 (ring-attention) splits each sequence's 30 positions into 8 equal parts (the zigzag");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.sp.size = 4; p.sp.mode = sequence::Mode::kUlysses; }, 4, [] {
               ModelShape s;
               s.heads = 6;
               s.context = 32;
               return s;
             }()),
             "Ulysses attention splits each rank's 6 heads (6) over sp 4");
  EXPECT_HAS(refusal([](HybridPlan& p) {
                p.sp.size = 2;
                p.tp.size = 2;
                p.tp.layers = {{"fc", ParallelStyle::columnwise()}};
                p.sp.mode = sequence::Mode::kUlysses;
              }, 4, [] {
                ModelShape s;
                s.heads = 2;
                return s;
              }()), "splits each rank's 1 heads (2 over tp 2) over sp 2");
  EXPECT_HAS(refusal([](HybridPlan& p) {
               p.pp.size = 2;
               p.pp.microbatches = 3;
               p.pp.schedule = pipeline::Schedule::kInterleaved1F1B;
               p.pp.virtual_stages = 2;
             }, 2),
             "interleaved-1f1b needs the microbatches (3) to be a multiple of the stages (2");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.pp.size = 2; p.pp.virtual_stages = 2; }, 2), "runs one stage per rank");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.pp.size = 2; p.pp.boundaries = {0, 3}; }, 2), "boundaries give 2 layer indices; 2 stages (size x virtual_stages) need 3");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.pp.size = 4; }, 4, gpt), "the model has 3 layers, fewer than the 4 pipeline stages");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.pp.size = 2; p.pp.boundaries = {0, 1, 3}; p.pp.trace = "t.json"; }, 2), "both pipeline boundaries and a trace");
  EXPECT_HAS(refusal([](HybridPlan& p) { p.pp.memory_weight = 2; }, 1), "memory_weight is 2");
  // Accepted: the same shapes at sizes that divide them.
  EXPECT_EQ(with([](HybridPlan& p) {
              p.tp.size = 2;
              p.tp.layers = {{"fc", ParallelStyle::columnwise()}};
              p.sp.size = 3;
              p.sp.mode = sequence::Mode::kRingSelfAttention;
            }).validated(12, gpt).dp,
            2);
}

}  // namespace
}  // namespace strata::parallel
