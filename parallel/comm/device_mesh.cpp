#include "strata/parallel/device_mesh.h"

#include <fmt/format.h>

#include <algorithm>

#include "strata/core/error.h"

namespace strata::parallel {

std::vector<int> DeviceMesh::group_ranks(const std::array<int, 4>& dims, int rank, const std::vector<Axis>& axes) {
  std::array<int, 4> c{};
  int rest = rank;
  for (int a = 3; a >= 0; --a) {
    c[a] = rest % dims[a];
    rest /= dims[a];
  }
  std::vector<int> ranks;
  // Walks the axes' coordinates as an odometer, the last axis fastest.
  std::vector<int> at(axes.size(), 0);
  for (;;) {
    for (size_t i = 0; i < axes.size(); ++i) c[axes[i]] = at[i];
    ranks.push_back(((c[0] * dims[1] + c[1]) * dims[2] + c[2]) * dims[3] + c[3]);
    size_t i = axes.size();
    while (i > 0 && ++at[i - 1] == dims[axes[i - 1]]) at[--i] = 0;
    if (i == 0) break;
  }
  return ranks;
}

// See Note [Device mesh].
DeviceMesh DeviceMesh::build(Communicator& world, std::array<int, 4> dims) {
  int product = 1;
  for (int d : dims) {
    STRATA_CHECK(d >= 1, "device mesh dimensions must be at least 1, got ", dims[0], " x ", dims[1], " x ", dims[2],
                 " x ", dims[3]);
    product *= d;
  }
  STRATA_CHECK(product == world.world_size(), "a ", dims[0], " x ", dims[1], " x ", dims[2], " x ", dims[3],
               " (dp x pp x tp x sp) mesh has ", product, " ranks, but the world has ", world.world_size(),
               ": choose sizes whose product is the number of ranks (strata run -n)");
  DeviceMesh m;
  m.dims_ = dims;
  m.world_rank_ = world.rank();
  const char* names[] = {"dp", "pp", "tp", "sp"};
  // The group's name: its axes, the mesh's shape and its first rank, the
  // same on every member. A split pairs members by name and by how often
  // each has used it, so the shape keeps two meshes' groups apart (rank 4
  // alone in one mesh, ranks 4 and 5 in the next).
  const auto make = [&](const std::vector<Axis>& axes, const std::string& name) {
    const std::vector<int> ranks = group_ranks(dims, world.rank(), axes);
    return std::shared_ptr<Communicator>(world.split(
        ranks, fmt::format("mesh-{}-{}x{}x{}x{}-{}", name, dims[0], dims[1], dims[2], dims[3], ranks.front())));
  };
  for (int a = 0; a < 4; ++a) {
    const std::vector<int> ranks = group_ranks(dims, world.rank(), static_cast<Axis>(a));
    m.coords_[a] = static_cast<int>(std::find(ranks.begin(), ranks.end(), world.rank()) - ranks.begin());
    m.groups_[a] = make({static_cast<Axis>(a)}, names[a]);
  }
  if (dims[kData] > 1 && dims[kSequence] > 1) {
    m.replicas_ = make({kData, kSequence}, "dp-sp");
  } else {
    m.replicas_ = dims[kSequence] > 1 ? m.groups_[kSequence] : m.groups_[kData];
  }
  return m;
}

DeviceMesh DeviceMesh::create(Communicator& world, std::array<int, 4> dims) { return build(world, dims); }

DeviceMesh DeviceMesh::create(std::shared_ptr<Communicator> world, std::array<int, 4> dims) {
  STRATA_CHECK(world != nullptr, "DeviceMesh::create needs a world communicator (make_world)");
  DeviceMesh m = build(*world, dims);
  m.world_ = std::move(world);
  return m;
}

std::string DeviceMesh::describe() const {
  return fmt::format("dp {} x pp {} x tp {} x sp {}", dims_[0], dims_[1], dims_[2], dims_[3]);
}

std::shared_ptr<Communicator> make_world(const Rendezvous& r, CommunicatorOptions options) {
  std::shared_ptr<Communicator> gloo = make_gloo_communicator(r, options);
  if (!nccl_available()) return gloo;
  return make_nccl_communicator(std::move(gloo), r.local_rank, options);
}

}  // namespace strata::parallel
