#include "strata/core/bytes.h"

#include <gtest/gtest.h>

#include "strata/core/error.h"

namespace strata {
namespace {

TEST(ParseBytes, AcceptsBinaryAndSiUnits) {
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("512MiB"), 512ull * 1024 * 1024);
  EXPECT_EQ(parse_bytes("2GiB"), 2ull * 1024 * 1024 * 1024);
  EXPECT_EQ(parse_bytes(" 1.5 GiB "), 3ull * 512 * 1024 * 1024);
  EXPECT_EQ(parse_bytes("3GB"), 3000000000ull);
  EXPECT_EQ(parse_bytes("7KB"), 7000u);
  EXPECT_EQ(parse_bytes("16K"), 16384u);
  EXPECT_EQ(parse_bytes("0"), 0u);
  EXPECT_EQ(parse_bytes("1TiB"), 1ull << 40);
}

TEST(ParseBytes, RejectsMalformedInputWithAHint) {
  for (const char* bad : {"", "GiB", "-1GiB", "12XB", "1..5GiB", "abc", "1.2.3MiB", "0.5B"}) {
    try {
      parse_bytes(bad);
      FAIL() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find(bad), std::string::npos) << e.message();
    }
  }
}

TEST(ParseBytes, RejectsOverflow) {
  EXPECT_THROW(parse_bytes("20000000000000000000"), Error);
  EXPECT_THROW(parse_bytes("17000000TiB"), Error);
  EXPECT_THROW(parse_bytes("16777216.5TiB"), Error);
}

TEST(FormatBytes, PicksTheLargestUnit) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(3 * kGiB / 2), "1.50 GiB");
}

TEST(RoundUp, RoundsToMultiples) {
  EXPECT_EQ(round_up(0, 4096), 0u);
  EXPECT_EQ(round_up(1, 4096), 4096u);
  EXPECT_EQ(round_up(4096, 4096), 4096u);
  EXPECT_EQ(round_up(4097, 4096), 8192u);
  EXPECT_EQ(round_up(10, 3), 12u);
}

}  // namespace
}  // namespace strata
