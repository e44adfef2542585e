#include "strata/core/error.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

namespace strata {
namespace {

TEST(Error, CheckCarriesMessageAndLocation) {
  try {
    const int budget = 3;
    STRATA_CHECK(budget > 4, "budget ", budget, " too small; raise it");
    FAIL() << "did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "budget 3 too small; raise it");
    EXPECT_NE(std::string(e.what()).find("error_test.cpp"), std::string::npos);
    EXPECT_GT(e.line(), 0);
  }
}

TEST(Error, AssertNamesTheBrokenInvariant) {
  try {
    STRATA_ASSERT(1 + 1 == 3, "arithmetic");
    FAIL() << "did not throw";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("internal assertion failed: 1 + 1 == 3"), std::string::npos) << e.message();
  }
}

TEST(Error, SyscallDecodesErrno) {
  try {
    STRATA_SYSCALL(::open("/nonexistent/strata/file", O_RDONLY), "opening the store");
    FAIL() << "did not throw";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("opening the store"), std::string::npos);
    EXPECT_NE(e.message().find("errno 2"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("No such file"), std::string::npos) << e.message();
  }
}

TEST(Error, NegErrnoDecodes) {
  EXPECT_NO_THROW(STRATA_CHECK_NEG_ERRNO(0, "ok"));
  try {
    STRATA_CHECK_NEG_ERRNO(-ENOSPC, "writing chunk 7");
    FAIL() << "did not throw";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("No space left on device"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("writing chunk 7"), std::string::npos);
  }
}

}  // namespace
}  // namespace strata
