// PartMap against element-by-element references: parts cut from a small
// matrix the ways tensor parallelism cuts parameters (rows, columns, grid
// blocks, fused blocks), and every pair's overlaps against a brute-force
// search for each element's twin.
#include "strata/checkpoint/part_map.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>

#include "strata/core/error.h"

namespace strata::checkpoint {
namespace {

constexpr int64_t kRows = 12, kCols = 8;

// The whole indices of the part of a kRows x kCols matrix selected by `keep(row, col)`,
// visited rows first within blocks of `row_blocks` (fused blocks concatenated).
std::vector<int64_t> cut(const std::function<bool(int64_t, int64_t)>& keep) {
  std::vector<int64_t> idx;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      if (keep(r, c)) idx.push_back(r * kCols + c);
    }
  }
  return idx;
}

struct Part {
  std::string name;
  std::vector<int64_t> index;
  PartMap map;
};

std::vector<Part> parts() {
  std::vector<Part> p;
  auto add = [&](std::string name, std::vector<int64_t> idx) {
    PartMap m = PartMap::from_indices({kRows, kCols}, idx.data(), static_cast<int64_t>(idx.size()));
    p.push_back({std::move(name), std::move(idx), std::move(m)});
  };
  std::vector<int64_t> all(kRows * kCols);
  for (int64_t i = 0; i < kRows * kCols; ++i) all[static_cast<size_t>(i)] = i;
  add("whole", all);
  for (int r = 0; r < 2; ++r) add("rows" + std::to_string(r), cut([&](int64_t i, int64_t) { return i / 6 == r; }));
  for (int r = 0; r < 4; ++r) add("cols" + std::to_string(r), cut([&](int64_t, int64_t j) { return j / 2 == r; }));
  for (int b = 0; b < 4; ++b) {
    add("block" + std::to_string(b), cut([&](int64_t i, int64_t j) { return i / 6 == b / 2 && j / 4 == b % 2; }));
  }
  // Fused: three blocks of 4 rows, rank r of 2 holding rows [2r, 2r + 2) of each, concatenated.
  for (int r = 0; r < 2; ++r) {
    std::vector<int64_t> idx;
    for (int f = 0; f < 3; ++f) {
      for (int64_t i = f * 4 + 2 * r; i < f * 4 + 2 * r + 2; ++i) {
        for (int64_t j = 0; j < kCols; ++j) idx.push_back(i * kCols + j);
      }
    }
    add("fused" + std::to_string(r), idx);
  }
  return p;
}

TEST(PartMap, RunsAreTheLongestConsecutiveStretches) {
  for (const Part& p : parts()) {
    p.map.check(p.name);
    EXPECT_EQ(p.map.part_elems(), static_cast<int64_t>(p.index.size())) << p.name;
    for (const PartMap::Run& r : p.map.runs) {
      for (int64_t k = 0; k < r.length; ++k) {
        ASSERT_EQ(p.index[static_cast<size_t>(r.part + k)], r.whole + k) << p.name;
      }
    }
    for (size_t i = 1; i < p.map.runs.size(); ++i) {  // merged: no run continues the one before
      EXPECT_NE(p.map.runs[i - 1].whole + p.map.runs[i - 1].length, p.map.runs[i].whole) << p.name;
    }
  }
  EXPECT_TRUE(parts()[0].map.is_whole());
  EXPECT_EQ(parts()[1].map.runs.size(), 1u);   // half the rows: one stretch
  EXPECT_EQ(parts()[3].map.runs.size(), 12u);  // a quarter of the columns: one per row
}

TEST(PartMap, OverlapsFindEveryElementsTwinAndNothingElse) {
  const std::vector<Part> all = parts();
  for (const Part& dst : all) {
    for (const Part& src : all) {
      std::map<int64_t, int64_t> src_at;  // whole index -> offset in src
      for (size_t k = 0; k < src.index.size(); ++k) src_at[src.index[k]] = static_cast<int64_t>(k);
      // A range cut out of the middle, as a ZeRO shard is.
      const int64_t n = dst.map.part_elems(), begin = n / 5, end = n - n / 7;
      std::map<int64_t, int64_t> expected;  // dst offset -> src offset
      for (int64_t k = begin; k < end; ++k) {
        const auto it = src_at.find(dst.index[static_cast<size_t>(k)]);
        if (it != src_at.end()) expected[k] = it->second;
      }
      std::map<int64_t, int64_t> got;
      for (const Overlap& o : overlaps(dst.map, begin, end, src.map)) {
        ASSERT_GT(o.length, 0);
        for (int64_t k = 0; k < o.length; ++k) {
          ASSERT_TRUE(got.emplace(o.dst + k, o.src + k).second) << dst.name << " <- " << src.name << ": twice";
        }
      }
      EXPECT_EQ(got, expected) << dst.name << " <- " << src.name;
    }
  }
}

TEST(PartMap, CheckRefusesMapsThatDoNotTileOrOverlapInTheWhole) {
  PartMap gap{{4, 4}, {{0, 0, 4}, {5, 8, 4}}};
  EXPECT_THROW(gap.check("gap"), Error);
  PartMap twice{{4, 4}, {{0, 0, 4}, {4, 2, 4}}};
  EXPECT_THROW(twice.check("twice"), Error);
  PartMap outside{{4, 4}, {{0, 14, 4}}};
  EXPECT_THROW(outside.check("outside"), Error);
  EXPECT_NO_THROW(PartMap::whole({4, 4}).check("whole"));
}

}  // namespace
}  // namespace strata::checkpoint
