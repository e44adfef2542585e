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
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  direct_ = fd_ >= 0;
  if (fd_ < 0 && errno == EINVAL) fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  STRATA_CHECK(fd_ >= 0, "cannot create ", path_, ": ", std::strerror(errno));
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
    const ssize_t n = ::write(fd_, buffer_ + done, length - done);
    if (n < 0 && errno == EINTR) continue;
    STRATA_CHECK(n > 0, "cannot write ", path_, ": ", n < 0 ? std::strerror(errno) : "no progress (disk full?)");
    done += static_cast<size_t>(n);
  }
  used_ = 0;
  kill_point("data");
}

void FileWriter::finish() {
  flush(true);
  if (direct_) {
    STRATA_CHECK(::ftruncate(fd_, static_cast<off_t>(bytes_)) == 0, "cannot truncate ", path_, ": ",
                 std::strerror(errno));
  }
  STRATA_CHECK(::fsync(fd_) == 0, "cannot fsync ", path_, ": ", std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  STRATA_CHECK(::close(fd) == 0, "cannot close ", path_, ": ", std::strerror(errno));
}

uint64_t FileWriter::checksum() const { return XXH3_64bits_digest(state(hash_)); }

void read_exact(int fd, const std::string& path, uint64_t offset, void* dst, size_t bytes) {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    STRATA_CHECK(n >= 0, "cannot read ", path, ": ", std::strerror(errno));
    STRATA_CHECK(n > 0, path, " is shorter than expected: nothing at byte ", offset, " (truncated?)");
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
}

FileDigest digest_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  STRATA_CHECK(fd >= 0, "cannot open ", path, ": ", std::strerror(errno));
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  std::vector<char> block(kBufferBytes);
  FileDigest d;
  try {
    for (;;) {
      const ssize_t n = ::read(fd, block.data(), block.size());
      if (n < 0 && errno == EINTR) continue;
      STRATA_CHECK(n >= 0, "cannot read ", path, ": ", std::strerror(errno));
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
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  STRATA_CHECK(fd >= 0, "cannot open directory ", dir, ": ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  STRATA_CHECK(rc == 0, "cannot fsync directory ", dir, ": ", std::strerror(err));
}

void kill_point(const char* point) {
  static const char* wanted = std::getenv("STRATA_CHECKPOINT_KILL_AT");
  if (wanted != nullptr && std::strcmp(wanted, point) == 0) ::raise(SIGKILL);
}

}  // namespace strata::checkpoint
