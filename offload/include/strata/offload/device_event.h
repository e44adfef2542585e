#pragma once
// DeviceEvent: a point in a device stream's work, as a cudaEvent_t is.
//
// Note [Copy streams and events]
// The device tier's copies run on two streams of their own, one per
// direction (host-to-device, device-to-host), so uploads, downloads and
// compute overlap. Ordering between them is by events, never by making the
// computing thread wait:
//  - a copy that reads or overwrites device memory compute used (an
//    eviction, a release) waits on the event recorded on the compute stream
//    when the memory was last used (DeviceMemory::compute_event), in the
//    copy stream itself;
//  - device memory given back is reused only once that event and the copy
//    reading it completed (DeviceArena defers the free);
//  - compute that needs a chunk a copy brought waits on the copy's event in
//    the compute stream (DeviceMemory::compute_wait).
// Under CUDA these are cudaEvent_t, cudaStreamWaitEvent and the copy
// streams; the compute stream is the legacy default stream, where LibTorch
// computes unless the user selects another. On the emulated device each copy
// stream is a CopyEngine with one worker thread, which runs its jobs in order:
// an event is the ticket of a job, a stream waiting on an event is a job
// that waits on that ticket, and the compute stream is the calling thread,
// whose work is complete when it returns (its event is complete at once).
// The same ordering rules run on both, so CPU tests check them.

#include <deque>
#include <memory>
#include <utility>

namespace strata::offload {

class DeviceEvent {
 public:
  /// What an event is on one kind of device (CUDA event, emulated ticket).
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual bool query() const = 0;
    /// Blocks the calling thread until complete; rethrows the failure of the work it follows.
    virtual void synchronize() const = 0;
  };

  /// An event that is complete: nothing to wait for.
  DeviceEvent() = default;
  explicit DeviceEvent(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

  /// Whether the work before it completed (successfully or not).
  bool query() const { return impl_ == nullptr || impl_->query(); }
  /// Host wait; rethrows the error of the copy it follows.
  void synchronize() const {
    if (impl_) impl_->synchronize();
  }
  /// Whether there is anything to wait for at all.
  bool pending() const { return impl_ != nullptr; }
  const Impl* impl() const { return impl_.get(); }

 private:
  std::shared_ptr<const Impl> impl_;
};

/// Items held until an event completes, oldest first: memory that work still
/// in flight may use (the device arena's deferred frees, the host sources of
/// uploads in the chunk manager). Not thread-safe: its owner's lock guards it.
template <typename T>
class EventGated {
 public:
  void push(T item, DeviceEvent after) { q_.push_back(Entry{std::move(item), std::move(after)}); }
  bool empty() const { return q_.empty(); }
  /// The event of the oldest item; empty() must be false.
  const DeviceEvent& oldest() const { return q_.front().after; }
  /// Calls release(item) for each item whose event completed (successfully
  /// or not) and drops it. Returns whether there was any.
  template <typename Fn>
  bool release_completed(Fn release) {
    bool any = false;
    for (auto it = q_.begin(); it != q_.end();) {
      if (!it->after.query()) {
        ++it;
        continue;
      }
      release(it->item);
      it = q_.erase(it);
      any = true;
    }
    return any;
  }
  template <typename Fn>
  void for_each(Fn fn) const {
    for (const Entry& e : q_) fn(e.item);
  }

 private:
  struct Entry {
    T item;
    DeviceEvent after;
  };
  std::deque<Entry> q_;
};

}  // namespace strata::offload
