#pragma once
// The ring exchange both ring attentions use. Private to strata_parallel.

#include <torch/torch.h>

#include "../comm/group_function.h"
#include "strata/parallel/communicator.h"

namespace strata::parallel::ring {

/// `x` to rank (r + step) mod N, and rank (r - step) mod N's `x` (same shape
/// and dtype) to here. A send completes only when its receiver is posted and
/// the communicator runs one operation at a time, so the ranks pair by
/// parity: even ranks send first, odd ranks receive first (no cycle of
/// waiting sends, for any N). `tag` keeps different exchanges apart.
inline torch::Tensor exchange(const torch::Tensor& x, Communicator& group, int step, uint32_t tag) {
  const int n = group.world_size(), r = group.rank();
  const int to = ((r + step) % n + n) % n, from = ((r - step) % n + n) % n;
  const torch::Tensor out_buf = group_ops::host_buffer(x);
  torch::Tensor in_buf = torch::empty_like(out_buf);
  const size_t bytes = out_buf.nbytes();
  if (r % 2 == 0) {
    group.send(out_buf.data_ptr(), bytes, to, tag)->wait();
    group.recv(in_buf.data_ptr(), bytes, from, tag)->wait();
  } else {
    group.recv(in_buf.data_ptr(), bytes, from, tag)->wait();
    group.send(out_buf.data_ptr(), bytes, to, tag)->wait();
  }
  return in_buf.to(x.device(), x.scalar_type());
}

}  // namespace strata::parallel::ring
