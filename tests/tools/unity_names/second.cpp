// A fixture for tools/check_unity_names.py (tests/CMakeLists.txt); see first.cpp.
#include <string>

namespace fixture {

using namespace std;

static string scaled(const string& s) { return s + s; }

namespace {
struct Local {
  int scaled_by(int k) const { return k; }  // a member: no finding
};
}  // namespace

}  // namespace fixture
