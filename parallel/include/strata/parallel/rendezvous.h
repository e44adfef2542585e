#pragma once
// Rendezvous: where a rank is in the job and where the ranks meet, read from
// the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or Slurm's; `strata run`
// (tools/run.cpp) starts local ranks with them. The communicators meet
// through LibTorch's c10d TCPStore at master_addr:master_port.

#include <string>

namespace strata::parallel {

struct Rendezvous {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// torchrun's variables, or Slurm's (SLURM_PROCID, SLURM_NTASKS,
  /// SLURM_LOCALID, SLURM_NTASKS_PER_NODE) when RANK is not set; a single
  /// process when neither is. Errors name the variable that does not parse.
  static Rendezvous from_env();
};

/// The environment variable `name` as an integer in [0, 2^30): `fallback`
/// when it is unset or empty; an Error naming it when it does not parse.
int env_int(const char* name, int fallback);

}  // namespace strata::parallel
