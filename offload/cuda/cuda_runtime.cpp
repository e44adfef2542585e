// The CUDA-runtime half of cuda_runtime.h; compiled only when the toolkit is found.
#include "strata/offload/cuda_runtime.h"

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "strata/core/cuda_check.h"
#include "strata/core/error.h"
#include "strata/core/log.h"

namespace strata::offload::cuda {

RuntimeInfo probe() {
  RuntimeInfo info;
  info.compiled = true;
  cudaRuntimeGetVersion(&info.runtime_version);
  if (cudaDriverGetVersion(&info.driver_version) != cudaSuccess) info.driver_version = 0;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    info.error = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error so later calls are not poisoned
    return info;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    DeviceInfo dev;
    dev.index = i;
    dev.name = prop.name;
    dev.total_bytes = prop.totalGlobalMem;
    dev.compute_major = prop.major;
    dev.compute_minor = prop.minor;
    size_t free_b = 0, total_b = 0;
    if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
      dev.free_bytes = free_b;
    }
    info.devices.push_back(dev);
  }
  if (info.devices.empty()) info.error = "no CUDA device";
  return info;
}

bool host_register(void* ptr, size_t bytes) noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return false;
  }
  const cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    STRATA_LOG(kWarn, "cudaHostRegister({} bytes) failed: {}; host memory stays pageable", bytes,
               cudaGetErrorString(err));
    cudaGetLastError();
    return false;
  }
  return true;
}

void host_unregister(void* ptr) noexcept {
  const cudaError_t err = cudaHostUnregister(ptr);
  if (err != cudaSuccess) {
    STRATA_LOG(kWarn, "cudaHostUnregister failed: {}", cudaGetErrorString(err));
    cudaGetLastError();
  }
}

void* device_malloc(int device, size_t bytes) {
  STRATA_CUDA_CHECK(cudaSetDevice(device), "selecting CUDA device ", device);
  void* ptr = nullptr;
  STRATA_CUDA_CHECK(cudaMalloc(&ptr, bytes), "allocating ", bytes, " bytes on cuda:", device);
  return ptr;
}

void device_free(int device, void* ptr) noexcept {
  if (ptr == nullptr) return;
  cudaSetDevice(device);
  const cudaError_t err = cudaFree(ptr);
  if (err != cudaSuccess) {
    STRATA_LOG(kError, "cudaFree on cuda:{} failed: {}", device, cudaGetErrorString(err));
    cudaGetLastError();
  }
}

namespace {

// One stream per direction and device, so uploads and downloads overlap with
// each other and with compute (Note [Copy streams and events]).
cudaStream_t direction_stream(int device, bool to_device) {
  static std::mutex mu;
  static std::map<std::pair<int, bool>, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mu);
  cudaStream_t& s = streams[{device, to_device}];
  if (s == nullptr) {
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "creating a copy stream on cuda:", device);
  }
  return s;
}

// A recorded cudaEvent_t; destroyed with the last DeviceEvent that holds it.
// `what` (a string literal) names the work it follows in errors; one is made
// per copy and per chunk an operator releases, so nothing is formatted here.
class CudaEvent final : public DeviceEvent::Impl {
 public:
  CudaEvent(int device, const char* what) : device_(device), what_(what) {
    STRATA_CUDA_CHECK(cudaSetDevice(device_), "selecting CUDA device ", device_);
    STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "creating an event for ", what_);
  }
  ~CudaEvent() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(cudaStream_t stream) const {
    STRATA_CUDA_CHECK(cudaEventRecord(event_, stream), "recording the event of ", what_);
  }
  bool query() const override {
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) return false;
    if (err != cudaSuccess) cudaGetLastError();
    return true;  // complete, or failed: either way nothing more will happen
  }
  void synchronize() const override {
    STRATA_CUDA_CHECK(cudaEventSynchronize(event_), what_, " on cuda:", device_);
  }
  cudaEvent_t get() const { return event_; }

 private:
  int device_;
  const char* what_;
  cudaEvent_t event_ = nullptr;
};

// Makes `stream` wait for `after`: in the stream for a CUDA event, on the host
// for any other kind (there is none on a CUDA device today).
void stream_wait(cudaStream_t stream, const DeviceEvent& after) {
  if (!after.pending()) return;
  if (const auto* e = dynamic_cast<const CudaEvent*>(after.impl())) {
    STRATA_CUDA_CHECK(cudaStreamWaitEvent(stream, e->get(), 0), "ordering a stream after an event");
  } else {
    after.synchronize();
  }
}

}  // namespace

DeviceEvent copy_async(int device, void* dst, const void* src, size_t bytes, bool to_device, const DeviceEvent& after) {
  STRATA_CUDA_CHECK(cudaSetDevice(device), "selecting CUDA device ", device);
  cudaStream_t stream = direction_stream(device, to_device);
  stream_wait(stream, after);
  auto done = std::make_shared<CudaEvent>(device, to_device ? "a copy host -> device" : "a copy device -> host");
  STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream),
                    "copying ", bytes, to_device ? " bytes host -> cuda:" : " bytes cuda:", device, to_device ? "" : " -> host");
  done->record(stream);
  return DeviceEvent(std::move(done));
}

DeviceEvent record_compute(int device) {
  auto e = std::make_shared<CudaEvent>(device, "compute");
  e->record(cudaStreamLegacy);
  return DeviceEvent(std::move(e));
}

void compute_wait(int device, const DeviceEvent& event) {
  if (!event.pending() || event.query()) return;
  STRATA_CUDA_CHECK(cudaSetDevice(device), "selecting CUDA device ", device);
  stream_wait(cudaStreamLegacy, event);
}

void device_memset_zero(int device, void* ptr, size_t bytes) {
  STRATA_CUDA_CHECK(cudaSetDevice(device), "selecting CUDA device ", device);
  cudaStream_t stream = direction_stream(device, true);
  STRATA_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream), "zeroing ", bytes, " bytes on cuda:", device);
  STRATA_CUDA_CHECK(cudaStreamSynchronize(stream), "zeroing ", bytes, " bytes on cuda:", device);
}

}  // namespace strata::offload::cuda
