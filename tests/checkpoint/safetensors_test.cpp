// safetensors: what strata writes, read back by an independent reader (the
// file parsed by hand here, not by strata's parser), and the parser's
// refusals of malformed headers.
#include "strata/checkpoint/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "error_of.h"
#include "strata/core/error.h"

namespace strata::checkpoint {
namespace {

std::string temp_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("strata-st-" + name + "-" + std::to_string(::getpid())))
      .string();
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Safetensors, WrittenFileReadsBackThroughAnIndependentReader) {
  const std::string path = temp_file("rt");
  std::vector<float> a(6), b(5);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.5f * static_cast<float>(i) - 1.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = 100.0f + static_cast<float>(i);
  const uint16_t c[3] = {0x3f80, 0x4000, 0xbf80};  // bf16 1, 2, -1
  {
    SafetensorsWriter w(path, {{"layer.weight", "F32", {2, 3}}, {"layer.bias", "F32", {5}}, {"emb", "BF16", {3}}},
                        {{"format", "pt"}});
    w.append(a.data(), 2 * sizeof(float));  // in pieces
    w.append(a.data() + 2, 4 * sizeof(float));
    w.append(b.data(), b.size() * sizeof(float));
    w.append(c, sizeof c);
    w.finish();
  }
  // The independent reader: length, JSON, offsets, raw little-endian values.
  const std::string file = slurp(path);
  ASSERT_GE(file.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(file[i]);
  EXPECT_EQ((8 + n) % 8, 0u) << "data 8-byte aligned";
  const nlohmann::json h = nlohmann::json::parse(file.substr(8, n));
  EXPECT_EQ(h["__metadata__"]["format"], "pt");
  const std::string data = file.substr(8 + n);
  auto check = [&](const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
                   const void* expected, size_t bytes) {
    const nlohmann::json& t = h.at(name);
    EXPECT_EQ(t["dtype"], dtype) << name;
    EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), shape) << name;
    const uint64_t begin = t["data_offsets"][0], end = t["data_offsets"][1];
    ASSERT_EQ(end - begin, bytes) << name;
    ASSERT_LE(end, data.size()) << name;
    EXPECT_EQ(std::memcmp(data.data() + begin, expected, bytes), 0) << name;
  };
  check("layer.weight", "F32", {2, 3}, a.data(), a.size() * 4);
  check("layer.bias", "F32", {5}, b.data(), b.size() * 4);
  check("emb", "BF16", {3}, c, sizeof c);
  EXPECT_EQ(data.size(), a.size() * 4 + b.size() * 4 + sizeof c) << "nothing after the last tensor";

  // And strata's own reader agrees.
  SafetensorsReader r(path);
  const TensorEntry* bias = r.header().find("layer.bias");
  ASSERT_NE(bias, nullptr);
  float got[2];
  r.read(*bias, 3 * sizeof(float), got, sizeof got);
  EXPECT_EQ(got[0], 103.0f);
  EXPECT_EQ(got[1], 104.0f);
  EXPECT_NE(error_of([&] { r.read(*bias, 4 * sizeof(float), got, sizeof got); }).find("past the end"),
            std::string::npos);
  std::filesystem::remove(path);
}

TEST(Safetensors, WriterRefusesShortOrLongData) {
  const std::string path = temp_file("short");
  SafetensorsWriter w(path, {{"x", "F32", {4}}});
  float v[5] = {};
  EXPECT_NE(error_of([&] { w.append(v, sizeof v); }).find("more than"), std::string::npos);
  w.append(v, 3 * sizeof(float));
  EXPECT_NE(error_of([&] { w.finish(); }).find("12 of the 16 declared bytes"), std::string::npos);
  std::filesystem::remove(path);
}

TEST(Safetensors, ParserRefusesWhatDoesNotAddUp) {
  auto parse = [](const std::string& text, uint64_t data) {
    return error_of([&] { parse_safetensors_header(text, data); });
  };
  EXPECT_NE(parse("{\"x\":", 0).find("not JSON"), std::string::npos);
  EXPECT_NE(parse("[1]", 0).find("not a JSON object"), std::string::npos);
  EXPECT_NE(parse(R"({"x":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", 4).find("unknown safetensors dtype"),
            std::string::npos);
  EXPECT_NE(parse(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 8).find("4 bytes for 2 elements"),
            std::string::npos);
  EXPECT_NE(parse(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4).find("outside"), std::string::npos);
  EXPECT_NE(parse(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8).find("non-negative"),
            std::string::npos);
  EXPECT_NE(parse(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("y":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
                  8)
                .find("overlap"),
            std::string::npos);
  EXPECT_NE(parse(R"({"x":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})", 4)
                .find("too large"),
            std::string::npos);
  EXPECT_EQ(parse(R"({"__metadata__":{"a":"b"},"x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})", 0),
            "no error");

  // Whole files: a length that does not fit, and a truncated data section.
  const std::string path = temp_file("bad");
  {
    SafetensorsWriter w(path, {{"x", "F32", {4}}});
    float v[4] = {1, 2, 3, 4};
    w.append(v, sizeof v);
    w.finish();
  }
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 4);
  EXPECT_NE(error_of([&] { SafetensorsReader r(path); }).find("outside"), std::string::npos);
  std::filesystem::resize_file(path, 12);
  EXPECT_NE(error_of([&] { SafetensorsReader r(path); }).find("does not fit"), std::string::npos);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace strata::checkpoint
