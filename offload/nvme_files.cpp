#include "nvme_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "strata/core/bytes.h"
#include "strata/core/error.h"
#include "strata/core/log.h"

namespace strata::offload::detail {
namespace {

void make_private_dir(const std::string& dir) {
  STRATA_CHECK(!dir.empty(), "the NVMe store needs a directory; set nvme_dir");
  std::string path;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    path = dir.substr(0, pos);
    if (path.empty()) continue;
    const int err = STRATA_SYSCALL_ERRNO(::mkdir(path.c_str(), 0700));
    if (err != 0 && err != EEXIST) STRATA_FAIL_ERRNO(err, "mkdir", "cannot create NVMe store directory ", path);
  }
  struct stat st {};
  STRATA_SYSCALL(::stat(dir.c_str(), &st), "cannot find NVMe store directory ", dir);
  STRATA_CHECK(S_ISDIR(st.st_mode), "NVMe store path ", dir, " is not a directory");
}

std::atomic<int> g_store_counter{0};

}  // namespace

StoreFiles::StoreFiles(const std::string& directory, uint64_t capacity, uint64_t max_file_bytes, bool direct_io,
                       uint64_t alignment) {
  make_private_dir(directory);
  reclaim_leftovers(directory);
  const int id = g_store_counter++;
  uint64_t remaining = round_up(capacity, alignment);
  const uint64_t max_file = std::max<uint64_t>(round_up(max_file_bytes, alignment), alignment);
  try {
    for (int i = 0; remaining > 0; ++i) {
      const uint64_t bytes = std::min(remaining, max_file);
      const std::string path = directory + "/strata-store-" + std::to_string(::getpid()) + "-" + std::to_string(id) +
                               "-" + std::to_string(i) + ".bin";
      const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | (direct_io ? O_DIRECT : 0);
      int fd = -1;
      const int err = STRATA_SYSCALL_ERRNO(fd = ::open(path.c_str(), flags, 0600));
      if (err != 0) {
        STRATA_FAIL_ERRNO(err, "open", "cannot create NVMe store file ", path,
                          err == EINVAL && direct_io ? " (the file system may not support O_DIRECT)" : "");
      }
      paths_.push_back(path);
      fds_.push_back(fd);
      STRATA_SYSCALL(::flock(fd, LOCK_EX | LOCK_NB), "cannot lock NVMe store file ", path);
      STRATA_SYSCALL(::fallocate(fd, 0, 0, static_cast<off_t>(bytes)), "cannot preallocate ", format_bytes(bytes),
                     " for NVMe store file ", path, " (lower the nvme budget or choose a directory with more free "
                     "space)");
      sizes_.push_back(bytes);
      remaining -= bytes;
    }
  } catch (...) {
    close_and_remove();
    throw;
  }
}

StoreFiles::~StoreFiles() { close_and_remove(); }

void StoreFiles::close_and_remove() noexcept {
  for (size_t i = 0; i < fds_.size(); ++i) {
    ::close(fds_[i]);  // nothing was written through it that a failed close could lose: the data is scratch
    const int err = STRATA_SYSCALL_ERRNO(::unlink(paths_[i].c_str()));
    if (err != 0) STRATA_LOG(kWarn, "could not remove NVMe store file {}: {}", paths_[i], errno_text(err));
  }
  fds_.clear();
  paths_.clear();
}

void StoreFiles::reclaim_leftovers(const std::string& directory) {
  DIR* const d = STRATA_SYSCALL(::opendir(directory.c_str()), "cannot list NVMe store directory ", directory);
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind("strata-store-", 0) != 0 || name.size() < 4 || name.substr(name.size() - 4) != ".bin") continue;
    const std::string path = directory + "/" + name;
    int fd = -1;
    if (STRATA_SYSCALL_ERRNO(fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC)) != 0) continue;  // gone, or not ours
    // A live store holds a lock on each of its files. A file nobody locks,
    // or whose owner (the pid in its name) is gone, belongs to a run that
    // did not shut down; the owner's io_uring can hold the lock for a
    // moment after the process died, hence the pid check.
    const pid_t owner = static_cast<pid_t>(std::atol(name.c_str() + std::strlen("strata-store-")));
    const bool owner_gone = owner > 0 && STRATA_SYSCALL_ERRNO(::kill(owner, 0)) == ESRCH;
    if (STRATA_SYSCALL_ERRNO(::flock(fd, LOCK_EX | LOCK_NB)) == 0 || owner_gone) {
      struct stat st {};
      const uint64_t bytes = STRATA_SYSCALL_ERRNO(::fstat(fd, &st)) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
      leftovers_.push_back({path, bytes});
      const int err = STRATA_SYSCALL_ERRNO(::unlink(path.c_str()));
      if (err == 0) {
        STRATA_LOG(kWarn, "reclaimed NVMe store file {} ({}) left by a run that did not shut down", path,
                   format_bytes(bytes));
      } else {
        STRATA_LOG(kWarn, "could not remove NVMe store file {} left by a run that did not shut down: {}", path,
                   errno_text(err));
      }
    }
    ::close(fd);
  }
  ::closedir(d);
}

}  // namespace strata::offload::detail
