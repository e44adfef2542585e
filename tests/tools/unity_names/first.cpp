// A fixture for tools/check_unity_names.py (tests/CMakeLists.txt): with
// second.cpp, each thing a unity batch would silently change. Never compiled.
#include <cstdint>

#define SQUARE(x) ((x) * (x))

namespace fixture {
namespace {

int64_t scaled(int64_t x) { return SQUARE(x) * 2; }

}  // namespace
}  // namespace fixture
