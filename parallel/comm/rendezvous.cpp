#include "strata/parallel/rendezvous.h"

#include <cstdlib>

#include "strata/core/error.h"

namespace strata::parallel {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  STRATA_CHECK(end != v && *end == '\0' && n >= 0 && n < (1 << 30), "environment variable ", name, "=\"", v,
               "\" is not a non-negative integer");
  return static_cast<int>(n);
}

Rendezvous Rendezvous::from_env() {
  Rendezvous r;
  if (std::getenv("RANK") != nullptr) {
    r.rank = env_int("RANK", 0);
    r.world_size = env_int("WORLD_SIZE", 1);
    r.local_rank = env_int("LOCAL_RANK", r.rank);
    r.local_world_size = env_int("LOCAL_WORLD_SIZE", r.world_size);
  } else if (std::getenv("SLURM_PROCID") != nullptr) {
    r.rank = env_int("SLURM_PROCID", 0);
    r.world_size = env_int("SLURM_NTASKS", 1);
    r.local_rank = env_int("SLURM_LOCALID", 0);
    r.local_world_size = env_int("SLURM_NTASKS_PER_NODE", r.world_size);
  }
  const char* addr = std::getenv("MASTER_ADDR");
  if (addr != nullptr && *addr != '\0') r.master_addr = addr;
  r.master_port = env_int("MASTER_PORT", 29500);
  STRATA_CHECK(r.world_size >= 1 && r.rank < r.world_size, "RANK ", r.rank, " is not below WORLD_SIZE ", r.world_size);
  return r;
}

}  // namespace strata::parallel
