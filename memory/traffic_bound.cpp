#include "strata/memory/traffic_bound.h"

#include <algorithm>

namespace strata::memory {

namespace {
uint64_t less_or_zero(uint64_t a, uint64_t b) { return a > b ? a - b : 0; }
}  // namespace

double Traffic::seconds(double read_gbps, double write_gbps) const {
  return (read_gbps > 0 ? static_cast<double>(read) / (read_gbps * 1e9) : 0.0) +
         (write_gbps > 0 ? static_cast<double>(written) / (write_gbps * 1e9) : 0.0);
}

TrafficBound least_step_traffic(const StepState& s) {
  const uint64_t e = s.persistent, g = s.gradients, m = s.memory;
  TrafficBound b;
  if (!s.global_barrier) {
    const uint64_t spill = less_or_zero(e, m);
    b.steady = b.one_step = {spill, spill};
    return b;
  }
  const uint64_t n = less_or_zero(e + g, m);  // on NVMe only at t*, at the least
  b.steady = {n, n};
  const uint64_t g_mem = std::min(g, m), e_mem = std::min(e, m - g_mem);
  b.one_step.read = (g - g_mem) + (e - e_mem);
  b.one_step.written = (g - g_mem) + less_or_zero(e, m);
  return b;
}

std::optional<Traffic> most_traffic_updating_in_backward(const StepState& s) {
  if (s.stored == 0) return std::nullopt;
  const uint64_t kept = less_or_zero(s.host, 3 * s.largest_update);  // on host across steps, at the least
  if (s.parameters > kept) return std::nullopt;
  const uint64_t moved = less_or_zero(s.stored, kept);
  return Traffic{moved, moved};
}

}  // namespace strata::memory
