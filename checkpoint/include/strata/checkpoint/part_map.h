#pragma once
// Where one rank's part of a parameter lies in the whole parameter, and which
// bytes of one part another part needs: what lets a checkpoint saved in one
// layout load in another.
//
// Note [Parts of a whole parameter]
// Tensor parallelism gives each rank a part of a parameter: rows, columns, a
// grid block, the rows of each fused block concatenated. Whatever the split,
// the part's elements (row-major, flattened) are runs of consecutive
// elements of the whole (row-major, flattened): a PartMap lists them, in the
// part's order, each as (offset in the part, offset in the whole, length).
// A whole parameter is one run. A checkpoint stores each part as saved, with
// its map; a rank of another layout reads, for the elements it holds (its
// own map, cut to its shard's range under ZeRO), the overlaps of its runs
// with the saved parts' runs (overlaps()). Nothing is assembled whole, and
// each rank reads exactly its elements.

#include <cstdint>
#include <string>
#include <vector>

namespace strata::checkpoint {

struct PartMap {
  struct Run {
    int64_t part = 0, whole = 0, length = 0;  // in elements
    bool operator==(const Run& o) const { return part == o.part && whole == o.whole && length == o.length; }
  };
  std::vector<int64_t> whole_shape;
  std::vector<Run> runs;  // by part offset, tiling [0, part_elems())

  /// The whole parameter of `shape`: one run.
  static PartMap whole(const std::vector<int64_t>& shape);
  /// From the whole parameter's flattened element index of each element of
  /// the part, in the part's order (runs merged).
  static PartMap from_indices(std::vector<int64_t> whole_shape, const int64_t* index, int64_t n);
  int64_t part_elems() const;
  int64_t whole_elems() const;
  bool is_whole() const;
  bool operator==(const PartMap& o) const { return whole_shape == o.whole_shape && runs == o.runs; }
  /// Throws an Error naming `what` unless the runs tile the part, lie inside
  /// the whole and never overlap there.
  void check(const std::string& what) const;
};

/// Elements both hold: `length` elements at `dst` in the destination part and
/// at `src` in the source part.
struct Overlap {
  int64_t dst = 0, src = 0, length = 0;
};
/// The overlaps of the destination part's elements [dst_begin, dst_end)
/// (offsets in its part) with the source part, by destination offset.
std::vector<Overlap> overlaps(const PartMap& dst, int64_t dst_begin, int64_t dst_end, const PartMap& src);

}  // namespace strata::checkpoint
