// The scalar instantiation of optim_impl.h; compiled with the scalar flags (kernels/CMakeLists.txt).
#include "optim_impl.h"

namespace strata::kernels::cpu {

const KernelTable& table_scalar() {
  static const KernelTable table = make_table<VecScalar>();
  return table;
}

}  // namespace strata::kernels::cpu
