// Version formatting shared by the CUDA and no-CUDA builds.
#include "strata/offload/cuda_runtime.h"

namespace strata::offload::cuda {

std::string format_cuda_version(int version) {
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

std::string format_nccl_version(int version) {
  return std::to_string(version / 10000) + "." + std::to_string((version % 10000) / 100) + "." +
         std::to_string(version % 100);
}

}  // namespace strata::offload::cuda
