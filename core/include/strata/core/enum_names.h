#pragma once
// One table of names per enum, read in both directions: enum_name() for
// messages, files and flags' defaults, parse_enum() for flags, environment
// variables and files. Printing and parsing cannot disagree, and a parse
// error lists every accepted spelling. A table may give a value more than
// one name (an alias such as "float32" for fp32); the first is the one
// printed.
//
//   constexpr EnumName<Tier> kTierNames[] = {{Tier::kDevice, "device"}, ...};
//   const char* tier_name(Tier t) { return enum_name(kTierNames, t); }
//   Tier parse_tier(const std::string& s) { return parse_enum(kTierNames, s, "tier"); }

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/error.h"

namespace strata {

template <typename E>
struct EnumName {
  E value;
  const char* name;
};

/// The first name `table` gives `value`, "?" for a value it does not list.
template <typename E, size_t N>
constexpr const char* enum_name(const EnumName<E> (&table)[N], E value) noexcept {
  for (const EnumName<E>& e : table) {
    if (e.value == value) return e.name;
  }
  return "?";
}

/// The value named `text` (any of its names); throws strata::Error saying
/// which `what` was unknown and listing each value's first name after
/// `verb`: unknown dtype "fp8"; use fp32, bf16 or fp16.
template <typename E, size_t N>
E parse_enum(const EnumName<E> (&table)[N], std::string_view text, const char* what, const char* verb = "use") {
  for (const EnumName<E>& e : table) {
    if (text == e.name) return e.value;
  }
  std::vector<const char*> names;
  for (size_t i = 0; i < N; ++i) {
    bool first = true;
    for (size_t j = 0; j < i; ++j) first = first && !(table[j].value == table[i].value);
    if (first) names.push_back(table[i].name);
  }
  std::string list;
  for (size_t i = 0; i < names.size(); ++i) {
    list += i == 0 ? "" : i + 1 == names.size() ? " or " : ", ";
    list += names[i];
  }
  STRATA_FAIL("unknown ", what, " \"", text, "\"; ", verb, " ", list);
}

}  // namespace strata
