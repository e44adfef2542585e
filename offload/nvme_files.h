#pragma once
// The NVMe store's files (nvme_store.h, "Files" and "Cleanup"): a private
// directory, one or a few preallocated files, each flock()ed while the store
// lives, and the files of crashed runs found and removed first. Owns the
// descriptors; the destructor closes and removes the files.

#include <cstdint>
#include <string>
#include <vector>

#include "strata/offload/nvme_store.h"

namespace strata::offload::detail {

class StoreFiles {
 public:
  /// Creates `directory` (0700) if needed, reclaims leftovers there, and
  /// creates files totalling `capacity` (rounded up to `alignment`), each at
  /// most `max_file_bytes`, opened O_DIRECT when `direct_io`.
  StoreFiles(const std::string& directory, uint64_t capacity, uint64_t max_file_bytes, bool direct_io,
             uint64_t alignment);
  ~StoreFiles();
  StoreFiles(const StoreFiles&) = delete;
  StoreFiles& operator=(const StoreFiles&) = delete;

  const std::vector<std::string>& paths() const { return paths_; }
  const std::vector<int>& fds() const { return fds_; }
  const std::vector<uint64_t>& sizes() const { return sizes_; }
  const std::vector<LeftoverFile>& leftovers() const { return leftovers_; }

 private:
  void reclaim_leftovers(const std::string& directory);
  void close_and_remove() noexcept;

  std::vector<std::string> paths_;
  std::vector<int> fds_;
  std::vector<uint64_t> sizes_;
  std::vector<LeftoverFile> leftovers_;
};

}  // namespace strata::offload::detail
