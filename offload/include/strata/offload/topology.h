#pragma once
// The machine as hwloc sees it: CPU model, cores, NUMA nodes and their memory.
// One topology is loaded per process (loading costs milliseconds) and shared.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace strata::offload {

struct NumaNode {
  unsigned os_index = 0;
  uint64_t local_memory_bytes = 0;
};

struct MachineTopology {
  std::string cpu_model;
  int packages = 0;
  int cores = 0;
  int hardware_threads = 0;
  std::vector<NumaNode> numa_nodes;
  std::string hwloc_version;
};

/// Describes the machine. Throws strata::Error when hwloc cannot load a topology.
const MachineTopology& machine_topology();

/// Binds the pages of [ptr, ptr+bytes) to NUMA node `os_index`. Returns false
/// (and logs) when the kernel refuses; memory then stays first-touch placed.
bool bind_to_numa_node(void* ptr, size_t bytes, unsigned os_index) noexcept;

/// The NUMA node of the CPU the calling thread last ran on (0 on one-node machines).
unsigned current_numa_node() noexcept;

}  // namespace strata::offload
