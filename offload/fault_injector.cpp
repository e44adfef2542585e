// FaultInjector (nvme_store.h): the store's test hooks, counting requests.
#include "strata/offload/nvme_store.h"

namespace strata::offload {

void FaultInjector::fail_request(int64_t nth, int error) {
  error_ = error;
  fail_at_ = seen_.load() + nth;
}
void FaultInjector::shorten_request(int64_t nth) { short_at_ = seen_.load() + nth; }
void FaultInjector::corrupt_request(int64_t nth, size_t byte) {
  byte_ = byte;
  corrupt_at_ = seen_.load() + nth;
}

FaultInjector::Fate FaultInjector::next() {
  const int64_t n = ++seen_;
  Fate f;
  if (n == fail_at_.load()) f.error = error_.load();
  f.shorten = n == short_at_.load();
  f.corrupt = n == corrupt_at_.load();
  f.byte = byte_.load();
  return f;
}

}  // namespace strata::offload
