// The NVMe store on real files through real io_uring, with injected faults.
#include "strata/offload/nvme_store.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <vector>

#include "strata/core/error.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
constexpr size_t kPage = 4096;

// A page-aligned buffer with a pattern derived from `seed`.
struct Buffer {
  size_t bytes;
  std::unique_ptr<char, decltype(&std::free)> data{nullptr, &std::free};
  explicit Buffer(size_t n, uint32_t seed = 0) : bytes(n) {
    data.reset(static_cast<char*>(std::aligned_alloc(kPage, n)));
    std::mt19937 rng(seed);
    for (size_t i = 0; i < n; ++i) data.get()[i] = static_cast<char>(rng());
  }
  bool operator==(const Buffer& o) const { return bytes == o.bytes && std::memcmp(data.get(), o.data.get(), bytes) == 0; }
  void* get() const { return data.get(); }
};

class NvmeStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata-nvme-test-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  NvmeStoreOptions options(uint64_t capacity = 64 << 20) {
    NvmeStoreOptions o;
    o.directory = (dir_ / "store").string();
    o.capacity = capacity;
    o.block_bytes = 256 << 10;
    o.queue_depth = 8;
    return o;
  }
  fs::path dir_;
};

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.message();
  }
  return "";
}

TEST_F(NvmeStoreTest, RoundTripsManyTransfersInFlight) {
  NvmeStore store(options());
  std::vector<Buffer> src, dst;
  std::vector<IoTicket> tickets;
  const size_t sizes[] = {kPage, 3 * kPage, (1 << 20) + kPage, 8 << 20};
  for (int i = 0; i < 12; ++i) {
    src.emplace_back(sizes[i % 4], i + 1);
    tickets.push_back(store.write_async(i, src.back().get(), src.back().bytes));
  }
  for (auto& t : tickets) store.wait(t);
  tickets.clear();
  for (int i = 0; i < 12; ++i) {
    dst.emplace_back(sizes[i % 4], 1000);
    tickets.push_back(store.read_async(i, dst.back().get(), dst.back().bytes));
  }
  for (int i = 0; i < 12; ++i) {
    store.wait(tickets[i]);
    EXPECT_TRUE(src[i] == dst[i]) << "chunk " << i;
    EXPECT_TRUE(store.test(tickets[i]));
  }
  const NvmeStoreStats s = store.stats();
  EXPECT_EQ(s.chunks, 12u);
  EXPECT_GT(s.requests, 24u) << "large transfers are split into blocks";
  EXPECT_EQ(s.bytes_read, s.bytes_written);
}

TEST_F(NvmeStoreTest, PrivateDirectoryPreallocatedFilesAndCleanup) {
  NvmeStoreOptions o = options(10 << 20);
  o.max_file_bytes = 4 << 20;
  std::vector<std::string> files;
  {
    NvmeStore store(o);
    files = store.files();
    ASSERT_EQ(files.size(), 3u) << "10 MiB in files of at most 4 MiB";
    struct stat st {};
    ASSERT_EQ(::stat(o.directory.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    uint64_t total = 0;
    for (const auto& f : files) {
      ASSERT_EQ(::stat(f.c_str(), &st), 0);
      EXPECT_EQ(st.st_mode & 0777, 0600u) << f;
      EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, static_cast<uint64_t>(st.st_size)) << "preallocated";
      total += st.st_size;
    }
    EXPECT_EQ(total, 10u << 20);
    Buffer b(kPage, 1);
    for (int i = 0; i < 200; ++i) store.write(i, b.get(), b.bytes);
    EXPECT_EQ(store.files().size(), 3u) << "no file per chunk";
  }
  for (const auto& f : files) EXPECT_FALSE(fs::exists(f)) << "removed on shutdown: " << f;
}

TEST_F(NvmeStoreTest, FreedExtentsAreReusedAndFullIsAClearError) {
  NvmeStore store(options(4 * kPage));
  Buffer a(2 * kPage, 1), b(2 * kPage, 2), c(2 * kPage, 3);
  store.write(1, a.get(), a.bytes);
  store.write(2, b.get(), b.bytes);
  const std::string full = error_of([&] { store.write(3, c.get(), c.bytes); });
  EXPECT_NE(full.find("NVMe store full"), std::string::npos) << full;
  EXPECT_NE(full.find("raise the nvme budget"), std::string::npos) << full;
  store.discard(1);
  store.write(3, c.get(), c.bytes);
  Buffer back(2 * kPage);
  store.read(3, back.get(), back.bytes);
  EXPECT_TRUE(back == c);
  store.read(2, back.get(), back.bytes);
  EXPECT_TRUE(back == b);
  EXPECT_EQ(store.stats().used, 4 * kPage);
}

TEST_F(NvmeStoreTest, FailedWriteKeepsThePreviousCopy) {
  auto faults = std::make_shared<FaultInjector>();
  NvmeStoreOptions o = options();
  o.faults = faults;
  NvmeStore store(o);
  Buffer v1(1 << 20, 1), v2(1 << 20, 2), back(1 << 20);
  store.write(7, v1.get(), v1.bytes);
  for (int err : {EIO, ENOSPC}) {
    faults->fail_request(3, err);  // the third of v2's four blocks
    const std::string msg = error_of([&] { store.write(7, v2.get(), v2.bytes); });
    EXPECT_NE(msg.find("NVMe write of chunk 7 failed at " + store.files()[0] + " offset "), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::strerror(err)), std::string::npos) << msg;
    store.read(7, back.get(), back.bytes);
    EXPECT_TRUE(back == v1) << "the previous copy survives a failed rewrite";
    EXPECT_EQ(store.stats().used, 1u << 20) << "the failed extent is returned";
  }
}

TEST_F(NvmeStoreTest, ReadFailuresAreErrorsNeverWrongData) {
  auto faults = std::make_shared<FaultInjector>();
  NvmeStoreOptions o = options();
  o.faults = faults;
  NvmeStore store(o);
  Buffer v(1 << 20, 5), back(1 << 20);
  store.write(3, v.get(), v.bytes);

  faults->corrupt_request(2, 1000);
  std::string msg = error_of([&] { store.read(3, back.get(), back.bytes); });
  EXPECT_NE(msg.find("NVMe chunk 3 is corrupt: checksum mismatch reading " + store.files()[0]), std::string::npos)
      << msg;

  faults->shorten_request(1);
  msg = error_of([&] { store.read(3, back.get(), back.bytes); });
  EXPECT_NE(msg.find("short NVMe read of chunk 3"), std::string::npos) << msg;

  faults->fail_request(4, EIO);
  msg = error_of([&] { store.read(3, back.get(), back.bytes); });
  EXPECT_NE(msg.find("NVMe read of chunk 3 failed"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;

  store.read(3, back.get(), back.bytes);  // without faults the data is intact
  EXPECT_TRUE(back == v);
}

TEST_F(NvmeStoreTest, BadRequestsAreClearErrors) {
  NvmeStore store(options());
  Buffer b(2 * kPage, 1);
  EXPECT_NE(error_of([&] { store.read(42, b.get(), b.bytes); }).find("not in the store"), std::string::npos);
  store.write(1, b.get(), b.bytes);
  EXPECT_NE(error_of([&] { store.read(1, b.get(), kPage); }).find("are stored"), std::string::npos);
  EXPECT_NE(error_of([&] { store.write(2, static_cast<char*>(b.get()) + 8, kPage); }).find("aligned"),
            std::string::npos);
  EXPECT_NE(error_of([&] { store.write(2, b.get(), 100); }).find("aligned"), std::string::npos);
}

TEST_F(NvmeStoreTest, LeftoversOfACrashedRunAreReclaimed) {
  const NvmeStoreOptions o = options(8 << 20);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    NvmeStore store(o);
    Buffer b(1 << 20, 9);
    store.write(1, b.get(), b.bytes);
    ::raise(SIGKILL);  // a crash: no destructor runs
    ::_exit(1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  size_t left = 0;
  for (const auto& e : fs::directory_iterator(o.directory)) left += e.path().filename().string().rfind("strata-store-", 0) == 0;
  ASSERT_EQ(left, 1u) << "the killed run left its file";

  NvmeStore live(o);  // a second store in the same directory must not be touched later
  ASSERT_EQ(live.reclaimed_leftovers().size(), 1u);
  EXPECT_EQ(live.reclaimed_leftovers()[0].bytes, 8u << 20);
  EXPECT_FALSE(fs::exists(live.reclaimed_leftovers()[0].path));
  NvmeStore other(o);
  EXPECT_TRUE(other.reclaimed_leftovers().empty()) << "a live store's files are locked, not leftovers";
  for (const auto& f : live.files()) EXPECT_TRUE(fs::exists(f));
}

// Transfers from and into a registered region go as WRITE_FIXED / READ_FIXED
// (every one of their block requests), transfers elsewhere do not, and the
// data is the same either way.
TEST_F(NvmeStoreTest, RegisteredBuffersUseFixedTransfers) {
  NvmeStore store(options());
  const size_t staging = store.stats().registered_buffers;
  ASSERT_GT(staging, 0u) << "the staging blocks could not be registered (RLIMIT_MEMLOCK?)";
  Buffer region(4 << 20, 11), back(4 << 20), plain(1 << 20, 12), plain_back(1 << 20);
  store.register_buffers({{region.get(), region.bytes}, {back.get(), back.bytes}});
  EXPECT_EQ(store.stats().registered_buffers, staging + 2);
  store.write(1, region.get(), region.bytes);
  store.read(1, back.get(), back.bytes);
  EXPECT_TRUE(back == region);
  const NvmeStoreStats fixed = store.stats();
  EXPECT_EQ(fixed.requests, 2 * region.bytes / options().block_bytes);
  EXPECT_EQ(fixed.fixed_requests, fixed.requests) << "every block of a registered region is a fixed transfer";
  store.write(2, plain.get(), plain.bytes);
  store.read(2, plain_back.get(), plain_back.bytes);
  EXPECT_TRUE(plain_back == plain);
  EXPECT_EQ(store.stats().fixed_requests, fixed.fixed_requests) << "unregistered memory is not";
  EXPECT_GT(store.stats().requests, fixed.requests);
}

TEST_F(NvmeStoreTest, StreamedTransfersPipelineBlocksAndVerify) {
  auto faults = std::make_shared<FaultInjector>();
  NvmeStoreOptions o = options();
  o.faults = faults;
  NvmeStore store(o);  // 256 KiB blocks, 4 staging blocks
  Buffer src((3 << 20) + 3 * kPage, 21), dst(src.bytes, 0);
  size_t expected_offset = 0;
  store.write_streamed(5, src.bytes, [&](size_t off, void* block, size_t len) {
    EXPECT_EQ(off, expected_offset) << "blocks are produced in order";
    expected_offset += len;
    std::memcpy(block, static_cast<char*>(src.get()) + off, len);
  });
  EXPECT_EQ(expected_offset, src.bytes);
  Buffer plain(src.bytes);
  store.read(5, plain.get(), plain.bytes);  // the streamed copy verifies through the plain path too
  EXPECT_TRUE(plain == src);
  size_t blocks = 0;
  store.read_streamed(5, dst.bytes, [&](size_t off, const void* block, size_t len) {
    std::memcpy(static_cast<char*>(dst.get()) + off, block, len);
    ++blocks;
  });
  EXPECT_TRUE(dst == src);
  EXPECT_EQ(blocks, (src.bytes + (256 << 10) - 1) / (256 << 10));

  faults->corrupt_request(7, 5);
  const std::string msg = error_of([&] { store.read_streamed(5, dst.bytes, [](size_t, const void*, size_t) {}); });
  EXPECT_NE(msg.find("NVMe chunk 5 is corrupt: checksum mismatch"), std::string::npos) << msg;

  // A failed streamed rewrite keeps the previous copy; so does a throwing source.
  Buffer other(src.bytes, 22);
  faults->fail_request(2, ENOSPC);
  EXPECT_NE(error_of([&] {
              store.write_streamed(5, other.bytes, [&](size_t off, void* block, size_t len) {
                std::memcpy(block, static_cast<char*>(other.get()) + off, len);
              });
            }).find("No space left on device"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              store.write_streamed(5, other.bytes, [&](size_t off, void*, size_t) {
                if (off > 0) throw Error("device copy failed", __FILE__, __LINE__);
              });
            }).find("device copy failed"),
            std::string::npos);
  store.read(5, plain.get(), plain.bytes);
  EXPECT_TRUE(plain == src);
  EXPECT_EQ(store.stats().used, src.bytes) << "failed streamed writes return their extents";
}

}  // namespace
}  // namespace strata::offload
