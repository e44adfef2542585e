// libFuzzer target for the parsers that read checkpoint files a user may hand
// strata: the safetensors file parser (length, JSON header, offsets) and the
// checkpoint manifest parser. The first input byte picks the parser. A
// strata::Error is the expected answer to bad input; anything else (a crash,
// a sanitizer report, another exception) is a finding.
//
//   scripts/fuzz.sh [SECONDS]   builds it with clang and runs it
#include <cstddef>
#include <cstdint>
#include <string>

#include "strata/checkpoint/checkpoint_dir.h"
#include "strata/checkpoint/safetensors.h"
#include "strata/core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t which = data[0] & 1;
  ++data;
  --size;
  try {
    if (which == 0) {
      const strata::checkpoint::SafetensorsHeader h = strata::checkpoint::parse_safetensors_file(data, size);
      for (const auto& t : h.tensors) {
        // What a reader would then do: the bytes it reads must be inside the file.
        if (h.data_start + t.end > size || t.end - t.begin != t.numel() * strata::checkpoint::dtype_bytes(t.dtype)) {
          __builtin_trap();
        }
      }
    } else {
      const strata::checkpoint::Manifest m =
          strata::checkpoint::manifest_from_json(std::string(reinterpret_cast<const char*>(data), size));
      for (const auto& f : m.files) {
        if (f.name.empty() || f.name.find('/') != std::string::npos) __builtin_trap();
      }
    }
  } catch (const strata::Error&) {
  }
  return 0;
}
