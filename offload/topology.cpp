#include "strata/offload/topology.h"

#include <hwloc.h>

#include <mutex>

#include "strata/core/error.h"
#include "strata/core/log.h"

namespace strata::offload {

namespace {

// The process-wide hwloc topology. Loaded once, never destroyed before exit
// (hwloc calls are then safe from any thread and any static destructor).
hwloc_topology_t shared_topology() {
  static hwloc_topology_t topo = [] {
    hwloc_topology_t t = nullptr;
    STRATA_CHECK(hwloc_topology_init(&t) == 0, "hwloc_topology_init failed");
    STRATA_CHECK(hwloc_topology_load(t) == 0, "hwloc_topology_load failed: cannot read the machine topology");
    return t;
  }();
  return topo;
}

std::mutex& topology_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

const MachineTopology& machine_topology() {
  static const MachineTopology topo = [] {
    std::lock_guard<std::mutex> lock(topology_mutex());
    hwloc_topology_t t = shared_topology();
    MachineTopology m;
    m.packages = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PACKAGE);
    m.cores = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE);
    m.hardware_threads = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PU);
    for (int i = 0; i < std::max(m.packages, 1); ++i) {
      hwloc_obj_t pkg = hwloc_get_obj_by_type(t, HWLOC_OBJ_PACKAGE, i);
      const char* model = pkg ? hwloc_obj_get_info_by_name(pkg, "CPUModel") : nullptr;
      if (model == nullptr) model = hwloc_obj_get_info_by_name(hwloc_get_root_obj(t), "CPUModel");
      if (model != nullptr) {
        m.cpu_model = model;
        break;
      }
    }
    if (m.cpu_model.empty()) m.cpu_model = "unknown";
    const int nodes = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
    for (int i = 0; i < nodes; ++i) {
      hwloc_obj_t node = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, i);
      m.numa_nodes.push_back({node->os_index, node->attr ? node->attr->numanode.local_memory : 0});
    }
    const unsigned v = hwloc_get_api_version();
    m.hwloc_version = "API " + std::to_string(v >> 16) + "." + std::to_string((v >> 8) & 0xff) + "." +
                      std::to_string(v & 0xff);
    return m;
  }();
  return topo;
}

bool bind_to_numa_node(void* ptr, size_t bytes, unsigned os_index) noexcept {
  try {
    std::lock_guard<std::mutex> lock(topology_mutex());
    hwloc_topology_t t = shared_topology();
    hwloc_obj_t node = hwloc_get_numanode_obj_by_os_index(t, os_index);
    if (node == nullptr) {
      STRATA_LOG(kWarn, "NUMA node {} does not exist; host memory left unbound", os_index);
      return false;
    }
    if (hwloc_set_area_membind(t, ptr, bytes, node->nodeset, HWLOC_MEMBIND_BIND,
                               HWLOC_MEMBIND_BYNODESET) != 0) {
      STRATA_LOG(kWarn, "binding {} bytes to NUMA node {} failed (errno {}); memory stays first-touch",
                 bytes, os_index, errno);
      return false;
    }
    return true;
  } catch (const std::exception& e) {
    STRATA_LOG(kWarn, "NUMA binding unavailable: {}", e.what());
    return false;
  }
}

unsigned current_numa_node() noexcept {
  try {
    std::lock_guard<std::mutex> lock(topology_mutex());
    hwloc_topology_t t = shared_topology();
    hwloc_bitmap_t cpuset = hwloc_bitmap_alloc();
    unsigned result = 0;
    if (hwloc_get_last_cpu_location(t, cpuset, HWLOC_CPUBIND_THREAD) == 0) {
      hwloc_bitmap_t nodeset = hwloc_bitmap_alloc();
      hwloc_cpuset_to_nodeset(t, cpuset, nodeset);
      const int first = hwloc_bitmap_first(nodeset);
      if (first >= 0) result = static_cast<unsigned>(first);
      hwloc_bitmap_free(nodeset);
    }
    hwloc_bitmap_free(cpuset);
    return result;
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace strata::offload
