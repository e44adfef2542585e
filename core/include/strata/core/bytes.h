#pragma once
// Byte sizes as users write them ("512MiB", "2GiB", "1.5GB", "4096") and as
// strata prints them. Binary suffixes are powers of 1024, SI suffixes powers of
// 1000, as in the IEC standard; a bare number is bytes.

#include <cstdint>
#include <string>
#include <string_view>

namespace strata {

/// Parses a human byte size. Throws strata::Error naming the input and the
/// accepted forms on anything else (negative, overflow, unknown suffix).
uint64_t parse_bytes(std::string_view text);

/// Formats with the largest binary unit that keeps the value >= 1, e.g. "1.50 GiB".
std::string format_bytes(uint64_t bytes);

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kGiB = 1024 * kMiB;

constexpr uint64_t round_up(uint64_t value, uint64_t multiple) {
  return multiple == 0 ? value : (value + multiple - 1) / multiple * multiple;
}

}  // namespace strata
