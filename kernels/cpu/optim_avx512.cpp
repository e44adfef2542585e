// The avx512 instantiation of optim_impl.h; compiled with the avx512 flags (kernels/CMakeLists.txt).
#include "optim_impl.h"

namespace strata::kernels::cpu {

const KernelTable& table_avx512() {
  static const KernelTable table = make_table<VecAvx512>();
  return table;
}

}  // namespace strata::kernels::cpu
