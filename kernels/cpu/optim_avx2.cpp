// The avx2 instantiation of optim_impl.h; compiled with the avx2 flags (kernels/CMakeLists.txt).
#include "optim_impl.h"

namespace strata::kernels::cpu {

const KernelTable& table_avx2() {
  static const KernelTable table = make_table<VecAvx2>();
  return table;
}

}  // namespace strata::kernels::cpu
