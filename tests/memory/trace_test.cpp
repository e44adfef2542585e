// The trace format: JSON round trip, the errors a reader gives, atomic writes,
// and the report's figures computed from a known trace.
#include "strata/memory/trace.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "strata/core/error.h"

namespace strata::memory {
namespace {

Trace sample() {
  Trace t;
  t.device = "emulated in host memory";
  t.non_model_source = "test";
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
  a.moves = {{"host", "device", 4096, 1}};
  a.stall_seconds = 0.001;
  TraceOp b = a;
  b.index = 1;
  b.name = "aten::gelu";
  b.phase = "backward";
  b.chunks.clear();
  b.non_model_peak = 900;
  b.moves = {{"host", "device", 4096, 1}, {"device", "host", 8192, 2}};
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
  v2.replace(v2.find("\"version\": 1"), 12, "\"version\": 2");
  EXPECT_NE(message(v2).find("trace version 2"), std::string::npos);
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

TEST(Trace, ReportSumsMovesStallsAndPadding) {
  const std::string r = format_trace_report(sample(), 1);
  EXPECT_NE(r.find("1 steps, 2 operators"), std::string::npos) << r;
  EXPECT_NE(r.find("host -> device         8.00 KiB        2"), std::string::npos) << r;
  EXPECT_NE(r.find("device -> host         8.00 KiB        2"), std::string::npos) << r;
  EXPECT_NE(r.find("stalls: 2.00 ms, 20.0% of step time"), std::string::npos) << r;
  EXPECT_NE(r.find("non-model peak at operator #1 aten::gelu (backward)"), std::string::npos) << r;
  EXPECT_NE(r.find("top 1 operators"), std::string::npos) << r;
  EXPECT_EQ(r.find("aten::addmm                          forward"), std::string::npos) << "only the top 1";
  // 1000 fp32 of 4096 bytes and 2048 bf16 of 4096 bytes: 8096 of 8192 used.
  EXPECT_NE(r.find("8.00 KiB allocated, 98.8% used by tensors, 96 B padding"), std::string::npos) << r;
  // One parameter chunk, used by one operator per step, fits the 4 KiB budget: moved once, either way.
  EXPECT_NE(r.find("replayed at this device budget: host -> device 4.00 KiB under lru, 4.00 KiB under auto"),
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
}  // namespace strata::memory
