// What `strata trace` shows of a trace (tools/trace_views.h): per-layer
// activations and the checkpointing prediction, the text report, the Chrome
// export and the SVG plot, each computed from a trace with known figures.
#include "trace_views.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "error_of.h"
#include "memory/sample_trace.h"

namespace strata::tools {
namespace {

using memory::Trace;
using memory::TraceOp;
using memory::testing::sample_trace;
Trace sample() { return sample_trace(); }

// Three layers' forwards, then backward: blocks.0 keeps 300 bytes (its
// operators and the GELU after it), blocks.1 keeps 500, the head 0.
Trace layered() {
  Trace t = sample();
  t.params = {"blocks.0.fc.weight", "blocks.1.fc.weight", "head.weight"};
  const auto op = [](const std::string& name, const std::string& phase, std::vector<int64_t> params, uint64_t after,
                     uint64_t peak, double seconds) {
    TraceOp o;
    o.name = name;
    o.phase = phase;
    o.params = std::move(params);
    o.non_model_bytes = after;
    o.non_model_peak = peak;
    o.seconds = seconds;
    return o;
  };
  t.ops = {op("aten::embedding", "forward", {}, 1000, 1000, 0.001),
           op("aten::addmm", "forward", {0}, 1200, 1200, 0.002),
           op("aten::gelu", "forward", {}, 1300, 1300, 0.001),
           op("aten::addmm", "forward", {1}, 1700, 1700, 0.003),
           op("aten::tanh", "forward", {}, 1800, 1800, 0.001),
           op("aten::addmm", "forward", {2}, 1800, 1900, 0.004),
           op("aten::mm", "backward", {1}, 1500, 2000, 0.002),
           op("strata::optimizer_step", "optimizer", {}, 0, 5000, 0.01)};
  for (size_t i = 0; i < t.ops.size(); ++i) t.ops[i].index = static_cast<int64_t>(i);
  t.steps = {{0, 0, static_cast<int64_t>(t.ops.size()), 0.05}};
  return t;
}

TEST(Trace, ActivationsPerLayerAndTheEffectOfCheckpointing) {
  const Trace t = layered();
  const std::vector<LayerActivations> layers = layer_activations(t);
  ASSERT_EQ(layers.size(), 3u);
  EXPECT_EQ(layers[0].layer, "blocks.0");
  EXPECT_EQ(layers[0].kept_bytes, 300u);
  EXPECT_EQ(layers[0].ops, 2);
  EXPECT_NEAR(layers[0].forward_seconds, 0.003, 1e-12);
  EXPECT_EQ(layers[1].layer, "blocks.1");
  EXPECT_EQ(layers[1].kept_bytes, 500u);
  EXPECT_EQ(layers[2].layer, "head");  // at most all but the last component
  EXPECT_EQ(layers[2].kept_bytes, 0u);
  // Depth 1: every block is one layer "blocks".
  const std::vector<LayerActivations> shallow = layer_activations(t, 1);
  ASSERT_EQ(shallow.size(), 2u);
  EXPECT_EQ(shallow[0].kept_bytes, 800u);

  const CheckpointPrediction p = predict_checkpointing(t, {"blocks.*"});
  EXPECT_EQ(p.layers, (std::vector<std::string>{"blocks.0", "blocks.1"}));
  EXPECT_EQ(p.freed_bytes, 800u);
  EXPECT_EQ(p.peak_before, 2000u);       // the optimizer's workspace is not an activation
  EXPECT_EQ(p.peak_after, 2000u - 300u);  // blocks.1's 500 come back while it is recomputed
  EXPECT_NEAR(p.recompute_seconds, 0.007, 1e-12);
  const std::string error = error_of([&] { predict_checkpointing(t, {"blocks.7"}); });
  EXPECT_NE(error.find("no layer matches blocks.7"), std::string::npos) << error;
  EXPECT_NE(format_trace_report(t).find("blocks.1"), std::string::npos);
}

TEST(Trace, ReportSumsMovesStallsAndPadding) {
  const std::string r = format_trace_report(sample(), 1);
  EXPECT_NE(r.find("1 steps, 2 operators"), std::string::npos) << r;
  EXPECT_NE(r.find("host -> device         8.00 KiB        2       4.00 KiB"), std::string::npos) << r;
  EXPECT_NE(r.find("device -> host         8.00 KiB        2       4.00 KiB"), std::string::npos) << r;
  EXPECT_NE(r.find("waits for moves in flight: 2.00 ms (8.00 KiB), 20.0% of step time"), std::string::npos) << r;
  EXPECT_NE(r.find("non-model peak at operator #1 aten::gelu (backward)"), std::string::npos) << r;
  EXPECT_NE(r.find("top 1 operators"), std::string::npos) << r;
  EXPECT_EQ(r.find("aten::addmm                          forward"), std::string::npos) << "only the top 1";
  // 1000 fp32 of 4096 bytes and 2048 bf16 of 4096 bytes: 8096 of 8192 used.
  EXPECT_NE(r.find("8.00 KiB allocated, 98.8% used by tensors, 96 B padding"), std::string::npos) << r;
  // One parameter chunk, used by one operator per step, fits the 4 KiB budget: moved once, either way.
  EXPECT_NE(r.find("replayed at this device budget, host -> device: 4.00 KiB under lru, 4.00 KiB under static, "
                   "4.00 KiB under auto"),
            std::string::npos) << r;
}

TEST(Trace, ChromeExportHasOperatorsMovesAndCounters) {
  const nlohmann::json j = nlohmann::json::parse(export_chrome_trace(sample()));
  int ops = 0, moves = 0, counters = 0, steps = 0;
  for (const auto& e : j.at("traceEvents")) {
    const std::string ph = e.at("ph");
    if (ph == "X" && e.at("tid") == 2) ops += 1;
    if (ph == "X" && e.at("tid") == 3) moves += 1;
    if (ph == "X" && e.at("tid") == 1) steps += 1;
    if (ph == "C" && e.at("name") == "model bytes") {
      counters += 1;
      EXPECT_EQ(e.at("args").at("device"), 4096);
    }
  }
  EXPECT_EQ(ops, 2);
  EXPECT_EQ(moves, 3) << "one slice per tier pair per operator";
  EXPECT_EQ(steps, 1);
  EXPECT_EQ(counters, 2);
}

TEST(Trace, SvgHasAPanelPerTierWithSeriesAndBudgets) {
  Trace t = sample();
  t.device = "a <device> & co";
  const std::string svg = plot_trace_svg(t);
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  for (const char* id : {"id=\"device\"", "id=\"host\"", "id=\"nvme\"", "class=\"model\"", "class=\"non-model\"",
                         "class=\"budget\"", "class=\"move\"", "class=\"step\""}) {
    EXPECT_NE(svg.find(id), std::string::npos) << id;
  }
  EXPECT_NE(svg.find("a &lt;device&gt; &amp; co"), std::string::npos) << "text is escaped";
  EXPECT_EQ(svg.find("<device>"), std::string::npos);
  EXPECT_NE(svg.find("budget 4.00 KiB"), std::string::npos);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
}

}  // namespace
}  // namespace strata::tools
