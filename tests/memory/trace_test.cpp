// The trace format: JSON round trip, the errors a reader gives, atomic writes,
// and the report's figures computed from a known trace.
#include "strata/memory/trace.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "error_of.h"
#include "strata/core/error.h"

namespace strata::memory {
namespace {

Trace sample() {
  Trace t;
  t.device = "emulated in host memory";
  t.non_model_source = "test";
  t.policy = "auto";
  t.budgets = {4096, 1 << 20, 0};
  t.chunks.push_back({0, 0, "param", "fp32", 4096, 1024, 1000});
  t.chunks.push_back({1, 0, "grad", "bf16", 4096, 2048, 2048});
  TraceOp a;
  a.index = 0;
  a.name = "aten::addmm";
  a.phase = "forward";
  a.seconds = 0.002;
  a.chunks = {{0, "host"}};
  a.model_bytes = {4096, 4096, 0};
  a.non_model_bytes = 100;
  a.non_model_peak = 300;
  a.moves = {{"host", "device", 4096, 1, 4096}};
  a.started = {{"host", "device", 4096, 1, 0}};
  a.stall_seconds = 0.001;
  a.stall_bytes = 4096;
  TraceOp b = a;
  b.index = 1;
  b.name = "aten::gelu";
  b.phase = "backward";
  b.chunks.clear();
  b.non_model_peak = 900;
  b.moves = {{"host", "device", 4096, 1, 0}, {"device", "host", 8192, 2, 4096}};
  t.ops = {a, b};
  t.steps.push_back({0, 0, 2, 0.01});
  return t;
}

TEST(Trace, JsonRoundTrip) {
  const Trace t = sample();
  const Trace r = trace_from_json(trace_to_json(t));
  EXPECT_EQ(trace_to_json(r), trace_to_json(t));
  ASSERT_EQ(r.ops.size(), 2u);
  EXPECT_EQ(r.ops[1].moves[1].bytes, 8192u);
  EXPECT_EQ(r.ops[1].moves[1].demand_bytes, 4096u);
  EXPECT_EQ(r.ops[0].started[0].count, 1u);
  EXPECT_EQ(r.chunks[1].dtype, "bf16");
  EXPECT_EQ(r.budgets[0], 4096u);
}

TEST(Trace, ReaderErrorsSayWhatIsWrong) {
  const std::string text = trace_to_json(sample());
  auto message = [](const std::string& s) {
    try {
      trace_from_json(s);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(text.substr(0, text.size() / 2)).find("cut short"), std::string::npos);
  EXPECT_NE(message("{\"format\": \"other\"}").find("not a strata trace"), std::string::npos);
  std::string v2 = text;
  v2.replace(v2.find("\"version\": 2"), 12, "\"version\": 3");
  EXPECT_NE(message(v2).find("trace version 3"), std::string::npos);
  std::string missing = text;
  missing.replace(missing.find("\"stall_seconds\""), 15, "\"stall_secs\"");
  EXPECT_NE(message(missing).find("malformed"), std::string::npos);
}

TEST(Trace, WriteIsAtomicAndReadBack) {
  const auto dir = std::filesystem::temp_directory_path() / ("strata-trace-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "t.json").string();
  write_trace(sample(), path);
  EXPECT_EQ(trace_to_json(read_trace(path)), trace_to_json(sample()));
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1u) << "no temporary file left behind";
  EXPECT_THROW(write_trace(sample(), (dir / "missing" / "t.json").string()), Error);
  EXPECT_THROW(read_trace((dir / "none.json").string()), Error);
  std::filesystem::remove_all(dir);
}

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

// Three 4 KiB parameter chunks in three families, used forward 0 1 2 and
// backward 2 1 0, each operator taking 2 s of compute, then the optimizer.
Trace three_chunks() {
  Trace t;
  t.device = "test";
  t.non_model_source = "test";
  t.policy = "lru";
  t.budgets = {8192, 1 << 20, 0};
  for (int f = 0; f < 3; ++f) {
    const int64_t base = 4 * f;
    t.chunks.push_back({base, f, "param", "fp32", 4096, 1024, 1024});
    t.chunks.push_back({base + 1, f, "grad", "fp32", 4096, 1024, 1024});
    t.chunks.push_back({base + 2, f, "optim", "fp32", 4096, 1024, 1024});
    t.chunks.push_back({base + 3, f, "optim", "fp32", 4096, 1024, 1024});
  }
  const int64_t order[] = {0, 4, 8, 8, 4, 0};
  for (int i = 0; i < 6; ++i) {
    TraceOp op;
    op.index = i;
    op.name = "aten::mm";
    op.phase = i < 3 ? "forward" : "backward";
    op.seconds = 2.0;
    op.chunks = {{order[i], "host"}};
    t.ops.push_back(op);
  }
  TraceOp step;
  step.index = 6;
  step.name = "strata::optimizer_step";
  step.phase = "optimizer";
  step.seconds = 3.0;
  t.ops.push_back(step);
  t.steps.push_back({0, 0, 7, 15.0});
  return t;
}

TEST(Simulate, PoliciesCountTheMovesOfAKnownSequence) {
  const Trace t = three_chunks();
  SimulateOptions so;
  so.device_budget = 8192;
  for (const char* policy : {"lru", "auto"}) {
    so.policy = policy;
    const SimulateResult r = simulate_trace(t, so);
    ASSERT_TRUE(r.fits);
    // 0 1 | 2 evicts 0 | 2 1 hit | 0 evicts 2 | the step takes 1 and 0 home.
    EXPECT_EQ(r.h2d_bytes, 4u * 4096) << policy;
    EXPECT_EQ(r.d2h_bytes, 4u * 4096) << policy;
  }
  // Static with no room to hold anything streams every chunk: each goes home
  // before the next operator that does not use it.
  so.policy = "static";
  SimulateResult r = simulate_trace(t, so);
  EXPECT_EQ(r.h2d_bytes, 5u * 4096);
  EXPECT_EQ(r.d2h_bytes, 5u * 4096);
  // With 12 KiB it holds chunk 0 (room after two streamed chunks), so 0 stays.
  so.device_budget = 12288;
  r = simulate_trace(t, so);
  EXPECT_EQ(r.h2d_bytes, 4u * 4096);
  // A budget below an operator's chunks does not fit.
  so.device_budget = 2048;
  r = simulate_trace(t, so);
  EXPECT_FALSE(r.fits);
  EXPECT_NE(r.why.find("needs 4.00 KiB"), std::string::npos) << r.why;
}

TEST(Simulate, PrefetchHidesCopiesBehindCompute) {
  const Trace t = three_chunks();
  SimulateOptions so;
  so.device_budget = 12288;
  so.policy = "auto";
  so.h2d_bytes_per_s = 4096;  // a second per chunk
  so.prefetch = false;
  const SimulateResult off = simulate_trace(t, so);
  EXPECT_DOUBLE_EQ(off.device_stall_seconds, 3.0) << "three loads, each waited for";
  EXPECT_EQ(off.prefetched_bytes, 0u);
  so.prefetch = true;
  const SimulateResult on = simulate_trace(t, so);
  // Chunk 0 on demand (1 s); 1 and 2 are loaded behind operator 0's 2 s:
  // 1 is ready at 4 s, a second after operator 1 could start; 2 is ready in time.
  EXPECT_DOUBLE_EQ(on.device_stall_seconds, 2.0);
  EXPECT_EQ(on.prefetched_bytes, 8192u);
  EXPECT_EQ(on.h2d_bytes, off.h2d_bytes);
  EXPECT_DOUBLE_EQ(on.compute_seconds, 15.0);
  EXPECT_DOUBLE_EQ(on.step_seconds, 17.0);
}

TEST(Simulate, NvmeHomedStateAndHostSpillPerStep) {
  Trace t = three_chunks();
  t.budgets[2] = 1 << 20;
  t.nvme_optim_fraction = 1.0 / 3;  // the last family
  SimulateOptions so;
  so.device_budget = 12288;
  so.host_budget = 1 << 20;
  SimulateResult r = simulate_trace(t, so);
  EXPECT_EQ(r.nvme_optim_families, 1u);
  EXPECT_EQ(r.nvme_read_bytes, 8192u);
  EXPECT_EQ(r.nvme_write_bytes, 8192u);
  EXPECT_EQ(r.host_spill_bytes, 0u);
  // Host holds 3 parameter, 3 gradient and 2 families' optimizer chunks (40
  // KiB) and the NVMe family in flight (8 KiB): at 44 KiB, 4 KiB spills.
  so.host_budget = 45056;
  r = simulate_trace(t, so);
  EXPECT_EQ(r.host_spill_bytes, 4096u);
  EXPECT_EQ(r.nvme_read_bytes, 8192u + 4096u);
  // Auto placement (-1) keeps state on host while it fits in half the host budget.
  t.nvme_optim_fraction = -1;
  so.host_budget = 32768;  // half is 16 KiB: two families' state
  r = simulate_trace(t, so);
  EXPECT_EQ(r.nvme_optim_families, 1u);
  // Without prefetch every read is a stall: 8 KiB + spill at 1 KiB/s.
  so.nvme_read_bytes_per_s = 1024;
  so.nvme_write_bytes_per_s = 1e12;
  so.prefetch = false;
  r = simulate_trace(t, so);
  const double reads = static_cast<double>(r.nvme_read_bytes) / 1024;
  EXPECT_DOUBLE_EQ(r.nvme_stall_seconds, reads);
  so.prefetch = true;
  EXPECT_LT(simulate_trace(t, so).nvme_stall_seconds, reads) << "reads overlap backward and the updates";
}

}  // namespace
}  // namespace strata::memory
