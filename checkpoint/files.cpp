#include "strata/checkpoint/files.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
#include <vector>

#include "strata/core/error.h"

namespace strata::checkpoint {
namespace {

constexpr size_t kBufferBytes = 4 << 20;
constexpr size_t kAlign = 4096;  // O_DIRECT's alignment on the filesystems strata targets

XXH3_state_t* state(void* p) { return static_cast<XXH3_state_t*>(p); }

}  // namespace

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

FileWriter::FileWriter(std::string path) : path_(std::move(path)) {
  // O_DIRECT where the file system takes it (EINVAL: tmpfs, some overlays).
  const int err = STRATA_SYSCALL_ERRNO(fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT,
                                                     0644));
  direct_ = err == 0;
  if (err == EINVAL) {
    fd_ = STRATA_SYSCALL(::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644), "cannot create ", path_);
  } else if (err != 0) {
    STRATA_FAIL_ERRNO(err, "open", "cannot create ", path_);
  }
  hash_ = XXH3_createState();
  buffer_ = static_cast<char*>(std::aligned_alloc(kAlign, kBufferBytes));
  if (hash_ == nullptr || buffer_ == nullptr) {
    ::close(fd_);
    XXH3_freeState(state(hash_));
    std::free(buffer_);
    STRATA_FAIL("out of memory for a checkpoint file's buffer");
  }
  XXH3_64bits_reset(state(hash_));
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (hash_ != nullptr) XXH3_freeState(state(hash_));
  std::free(buffer_);
}

void FileWriter::write(const void* data, size_t bytes) {
  STRATA_CHECK(fd_ >= 0, "write to ", path_, " after it was finished");
  XXH3_64bits_update(state(hash_), data, bytes);
  bytes_ += bytes;
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const size_t take = std::min(bytes, kBufferBytes - used_);
    std::memcpy(buffer_ + used_, p, take);
    used_ += take;
    p += take;
    bytes -= take;
    if (used_ == kBufferBytes) flush(false);
  }
}

// Writes the buffer. With O_DIRECT every write is a whole number of aligned
// blocks: the last one is padded with zeros and the file truncated after.
void FileWriter::flush(bool last) {
  size_t length = used_;
  if (direct_ && last) {
    length = (used_ + kAlign - 1) / kAlign * kAlign;
    std::memset(buffer_ + used_, 0, length - used_);
  }
  size_t done = 0;
  while (done < length) {
    const ssize_t n = STRATA_SYSCALL(::write(fd_, buffer_ + done, length - done), "cannot write ", path_);
    STRATA_CHECK(n > 0, "cannot write ", path_, ": no progress (disk full?)");
    done += static_cast<size_t>(n);
  }
  used_ = 0;
  kill_point("data");
}

void FileWriter::finish() {
  flush(true);
  if (direct_) {
    STRATA_SYSCALL(::ftruncate(fd_, static_cast<off_t>(bytes_)), "cannot truncate ", path_);
  }
  STRATA_SYSCALL(::fsync(fd_), "cannot fsync ", path_);
  const int fd = fd_;
  fd_ = -1;
  STRATA_CLOSE(fd, "cannot close ", path_);
}

uint64_t FileWriter::checksum() const { return XXH3_64bits_digest(state(hash_)); }

void read_exact(int fd, const std::string& path, uint64_t offset, void* dst, size_t bytes) {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    const ssize_t n = STRATA_SYSCALL(::pread(fd, p, bytes, static_cast<off_t>(offset)), "cannot read ", path);
    STRATA_CHECK(n > 0, path, " is shorter than expected: nothing at byte ", offset, " (truncated?)");
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
}

FileDigest digest_file(const std::string& path) {
  const int fd = STRATA_SYSCALL(::open(path.c_str(), O_RDONLY | O_CLOEXEC), "cannot open ", path);
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  std::vector<char> block(kBufferBytes);
  FileDigest d;
  try {
    for (;;) {
      const ssize_t n = STRATA_SYSCALL(::read(fd, block.data(), block.size()), "cannot read ", path);
      if (n == 0) break;
      XXH3_64bits_update(h, block.data(), static_cast<size_t>(n));
      d.bytes += static_cast<uint64_t>(n);
    }
  } catch (...) {
    XXH3_freeState(h);
    ::close(fd);
    throw;
  }
  d.checksum = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  ::close(fd);
  return d;
}

void sync_directory(const std::string& dir) {
  const int fd = STRATA_SYSCALL(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC), "cannot open directory ", dir);
  const int err = STRATA_SYSCALL_ERRNO(::fsync(fd));
  ::close(fd);
  if (err != 0) STRATA_FAIL_ERRNO(err, "fsync", "cannot fsync directory ", dir);
}

void kill_point(const char* point) {
  static const char* wanted = std::getenv("STRATA_CHECKPOINT_KILL_AT");
  if (wanted != nullptr && std::strcmp(wanted, point) == 0) ::raise(SIGKILL);
}

}  // namespace strata::checkpoint
