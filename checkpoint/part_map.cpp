// PartMap: Note [Parts of a whole parameter] (part_map.h).
#include "strata/checkpoint/part_map.h"

#include <algorithm>

#include "strata/core/error.h"

namespace strata::checkpoint {

namespace {

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

}  // namespace

PartMap PartMap::whole(const std::vector<int64_t>& shape) {
  PartMap m;
  m.whole_shape = shape;
  const int64_t n = product(shape);
  if (n > 0) m.runs.push_back({0, 0, n});
  return m;
}

PartMap PartMap::from_indices(std::vector<int64_t> whole_shape, const int64_t* index, int64_t n) {
  PartMap m;
  m.whole_shape = std::move(whole_shape);
  for (int64_t i = 0; i < n; ++i) {
    if (!m.runs.empty() && m.runs.back().whole + m.runs.back().length == index[i]) {
      ++m.runs.back().length;
    } else {
      m.runs.push_back({i, index[i], 1});
    }
  }
  return m;
}

int64_t PartMap::part_elems() const { return runs.empty() ? 0 : runs.back().part + runs.back().length; }
int64_t PartMap::whole_elems() const { return product(whole_shape); }

bool PartMap::is_whole() const {
  return runs.size() == 1 && runs[0].part == 0 && runs[0].whole == 0 && runs[0].length == whole_elems();
}

void PartMap::check(const std::string& what) const {
  int64_t at = 0;
  const int64_t n = whole_elems();
  for (const Run& r : runs) {
    STRATA_CHECK(r.length > 0 && r.part == at && r.whole >= 0 && r.whole + r.length <= n, what,
                 ": a malformed part map (run at part offset ", r.part, ", whole offset ", r.whole, ", length ",
                 r.length, ", of a whole of ", n, " elements)");
    at += r.length;
  }
  std::vector<Run> by_whole = runs;
  std::sort(by_whole.begin(), by_whole.end(), [](const Run& a, const Run& b) { return a.whole < b.whole; });
  for (size_t i = 1; i < by_whole.size(); ++i) {
    STRATA_CHECK(by_whole[i - 1].whole + by_whole[i - 1].length <= by_whole[i].whole, what,
                 ": a malformed part map (two runs hold whole element ", by_whole[i].whole, ")");
  }
}

std::vector<Overlap> overlaps(const PartMap& dst, int64_t dst_begin, int64_t dst_end, const PartMap& src) {
  std::vector<PartMap::Run> by_whole = src.runs;
  std::sort(by_whole.begin(), by_whole.end(),
            [](const PartMap::Run& a, const PartMap::Run& b) { return a.whole < b.whole; });
  std::vector<Overlap> out;
  for (const PartMap::Run& d : dst.runs) {
    const int64_t lo = std::max(d.part, dst_begin), hi = std::min(d.part + d.length, dst_end);
    if (lo >= hi) continue;
    // The destination's elements [lo, hi) are whole elements [w0, w1).
    const int64_t w0 = d.whole + (lo - d.part), w1 = d.whole + (hi - d.part);
    auto it = std::upper_bound(by_whole.begin(), by_whole.end(), w0,
                               [](int64_t w, const PartMap::Run& r) { return w < r.whole; });
    if (it != by_whole.begin()) --it;
    for (; it != by_whole.end() && it->whole < w1; ++it) {
      const int64_t a = std::max(w0, it->whole), b = std::min(w1, it->whole + it->length);
      if (a >= b) continue;
      out.push_back({lo + (a - w0), it->part + (a - it->whole), b - a});
    }
  }
  std::sort(out.begin(), out.end(), [](const Overlap& a, const Overlap& b) { return a.dst < b.dst; });
  return out;
}

}  // namespace strata::checkpoint
