#include "strata/core/bytes.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>

#include <fmt/format.h>

#include "strata/core/error.h"

namespace strata {

namespace {
struct Suffix {
  std::string_view name;
  uint64_t factor;
};
constexpr Suffix kSuffixes[] = {
    {"", 1},           {"B", 1},
    {"KiB", kKiB},     {"MiB", kMiB},       {"GiB", kGiB},        {"TiB", kGiB * 1024},
    {"KB", 1000},      {"MB", 1000 * 1000}, {"GB", 1000000000ull}, {"TB", 1000000000000ull},
    {"K", kKiB},       {"M", kMiB},         {"G", kGiB},           {"T", kGiB * 1024},
};

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}
}  // namespace

uint64_t parse_bytes(std::string_view text) {
  const std::string_view s = trim(text);
  size_t pos = 0;
  while (pos < s.size() && (std::isdigit(static_cast<unsigned char>(s[pos])) || s[pos] == '.')) ++pos;
  const std::string number(s.substr(0, pos));
  const std::string_view suffix = trim(s.substr(pos));
  STRATA_CHECK(!number.empty() && number != "." && number.find('.') == number.rfind('.'),
               "invalid byte size '", text,
               "': expected a non-negative number with an optional unit, e.g. 4096, 512MiB, 2GiB, 1.5GB");
  for (const Suffix& sfx : kSuffixes) {
    if (suffix != sfx.name) continue;
    if (number.find('.') == std::string::npos) {
      errno = 0;
      const unsigned long long value = std::strtoull(number.c_str(), nullptr, 10);
      STRATA_CHECK(errno != ERANGE && value <= std::numeric_limits<uint64_t>::max() / sfx.factor,
                   "byte size '", text, "' does not fit in 64 bits");
      return value * sfx.factor;
    }
    const long double value = std::strtold(number.c_str(), nullptr) * static_cast<long double>(sfx.factor);
    STRATA_CHECK(value < 18446744073709551615.0L, "byte size '", text, "' does not fit in 64 bits");
    const long double rounded = std::floor(value);
    STRATA_CHECK(rounded == value, "byte size '", text, "' is not a whole number of bytes");
    return static_cast<uint64_t>(rounded);
  }
  STRATA_FAIL("invalid byte size '", text, "': unknown unit '", suffix,
              "'; use B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)");
}

std::string format_bytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < kKiB) return fmt::format("{} B", bytes);
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.2f} {}", value, kUnits[unit]);
}

}  // namespace strata
