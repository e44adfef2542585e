#include "strata/offload/topology.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include "strata/offload/io_uring_probe.h"

namespace strata::offload {
namespace {

TEST(Topology, MatchesTheOperatingSystem) {
  const MachineTopology& t = machine_topology();
  EXPECT_GE(t.cores, 1);
  EXPECT_GE(t.hardware_threads, t.cores);
  // hwloc sees the CPUs this process may use; sysconf sees the online ones.
  EXPECT_LE(t.hardware_threads, sysconf(_SC_NPROCESSORS_ONLN));
  ASSERT_GE(t.numa_nodes.size(), 1u);
  EXPECT_GT(t.numa_nodes[0].local_memory_bytes, 0u);
  EXPECT_FALSE(t.cpu_model.empty());
}

TEST(Topology, CurrentNodeIsOneOfTheNodes) {
  const unsigned node = current_numa_node();
  bool found = false;
  for (const auto& n : machine_topology().numa_nodes) found = found || n.os_index == node;
  EXPECT_TRUE(found);
}

TEST(IoUring, ProbeReportsKernelAndOutcome) {
  const IoUringSupport s = probe_io_uring();
  EXPECT_FALSE(s.kernel_release.empty());
  EXPECT_FALSE(s.detail.empty());
}

}  // namespace
}  // namespace strata::offload
