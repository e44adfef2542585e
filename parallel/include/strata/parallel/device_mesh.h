#pragma once
// DeviceMesh: the one source of a job's process groups. docs/parallel.md.
//
// Note [Device mesh]
// The world as a dp x pp x tp x sp grid, sp varying fastest, then tp, pp and
// dp: rank = ((dp_i * pp + pp_i) * tp + tp_i) * sp + sp_i, so tensor and
// sequence groups are neighbouring ranks (one node). Each rank joins the
// four groups along the axes through it, and the replica group: the ranks
// that differ only in dp and sp, which hold the same parameters and average
// their gradients (each trains on its own batch, or its own positions of
// one). Every group is made at create(), on every rank in the same order, so
// no later call needs a collective to find one; the groups are shared
// (std::shared_ptr), and a copy of the mesh shares them. Layers take their
// group from here: DeviceMesh::group(kTensor) for parallelize(), kPipeline
// for pipeline::Pipeline, kSequence for sequence::Attention, replicas() for
// attach().

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "strata/parallel/communicator.h"

namespace strata::parallel {

class DeviceMesh {
 public:
  enum Axis { kData = 0, kPipeline = 1, kTensor = 2, kSequence = 3 };

  /// Builds the mesh over `world`: dp * pp * tp * sp must equal its size
  /// (checked before any collective). Collective over the world.
  static DeviceMesh create(std::shared_ptr<Communicator> world, std::array<int, 4> dims);
  /// The same over a world the caller keeps alive for as long as the mesh.
  static DeviceMesh create(Communicator& world, std::array<int, 4> dims);
  /// The ranks (of the world) in `rank`'s group along `axes`, in the group's
  /// order (the first axis given varies slowest).
  static std::vector<int> group_ranks(const std::array<int, 4>& dims, int rank, const std::vector<Axis>& axes);
  static std::vector<int> group_ranks(const std::array<int, 4>& dims, int rank, Axis axis) {
    return group_ranks(dims, rank, std::vector<Axis>{axis});
  }

  const std::array<int, 4>& dims() const { return dims_; }  // dp, pp, tp, sp
  int size(Axis axis) const { return dims_[axis]; }
  /// This rank's place along `axis`.
  int coord(Axis axis) const { return coords_[axis]; }
  const std::array<int, 4>& coords() const { return coords_; }
  int rank() const { return world_rank_; }
  int world_size() const { return dims_[0] * dims_[1] * dims_[2] * dims_[3]; }
  /// The group along `axis` through this rank (a group of one where the axis has size 1).
  const std::shared_ptr<Communicator>& group(Axis axis) const { return groups_[axis]; }
  /// dp x sp through this rank: the group attach() averages gradients over and
  /// ZeRO shards state over. The data or sequence group itself when the other has size 1.
  const std::shared_ptr<Communicator>& replicas() const { return replicas_; }
  /// The world it was made from; null when made from a Communicator&.
  const std::shared_ptr<Communicator>& world() const { return world_; }
  /// "dp 2 x pp 2 x tp 2 x sp 1".
  std::string describe() const;

 private:
  static DeviceMesh build(Communicator& world, std::array<int, 4> dims);

  std::array<int, 4> dims_{1, 1, 1, 1};
  std::array<int, 4> coords_{0, 0, 0, 0};
  int world_rank_ = 0;
  std::array<std::shared_ptr<Communicator>, 4> groups_;
  std::shared_ptr<Communicator> replicas_;
  std::shared_ptr<Communicator> world_;
};

/// This process's world: NCCL over a Gloo bootstrap where this build has
/// NCCL and the process sees a GPU (on device LOCAL_RANK), Gloo otherwise.
/// Meets the other ranks at `r` (Rendezvous::from_env()).
std::shared_ptr<Communicator> make_world(const Rendezvous& r, CommunicatorOptions options = {});

}  // namespace strata::parallel
