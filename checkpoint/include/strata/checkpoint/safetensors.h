#pragma once
// The safetensors format (https://github.com/huggingface/safetensors): an
// 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
//    ..., "__metadata__": {"key": "value"}}
// then the tensors' raw little-endian bytes, offsets relative to the end of
// the header. Python's `safetensors` and `transformers` read what this
// writes; strata writes its checkpoints' tensor files in it too.
//
// The parser trusts nothing: the length, the JSON, every dtype, shape and
// offset are checked against each other and the file's size, so a truncated
// or hostile file is an Error naming the problem, never a crash or an
// out-of-bounds read (fuzzed: fuzz/fuzz_checkpoint.cpp).

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "strata/checkpoint/files.h"

namespace strata::checkpoint {

struct TensorEntry {
  std::string name;
  std::string dtype;  // F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets in the data section
  uint64_t numel() const;
};

/// Bytes per element of a safetensors dtype; throws on an unknown one.
size_t dtype_bytes(const std::string& dtype);

struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // sorted by offset
  std::unordered_map<std::string, size_t> index;  // name -> position in `tensors`
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + N
  const TensorEntry* find(const std::string& name) const;
};

/// The largest header strata accepts (the reference implementation's limit).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

/// Parses the JSON header text. `data_bytes` is the size of the data section
/// (file size less 8 + N): every tensor must lie inside it, tensors must not
/// overlap, and each one's bytes must equal its shape times its dtype's size.
SafetensorsHeader parse_safetensors_header(const std::string& json_text, uint64_t data_bytes);

/// Parses a whole safetensors file held in memory: the length, the header,
/// and every tensor's place in the data that follows.
SafetensorsHeader parse_safetensors_file(const void* data, size_t size);

/// Writes a safetensors file tensor by tensor in the order declared, without
/// holding more than one write buffer: declare every tensor first (the header
/// goes first), then append each tensor's bytes, in order, in any number of
/// pieces.
class SafetensorsWriter {
 public:
  struct Spec {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(std::string path, const std::vector<Spec>& tensors,
                    const std::map<std::string, std::string>& metadata = {});
  /// Appends bytes of the current tensor (moving to the next when full).
  void append(const void* data, size_t bytes);
  /// Checks every tensor was written in full; flush, fsync, close.
  void finish();
  uint64_t bytes() const { return file_.bytes(); }
  uint64_t checksum() const { return file_.checksum(); }

 private:
  FileWriter file_;
  std::vector<uint64_t> ends_;  // data offset where each tensor ends
  uint64_t written_ = 0;
};

/// Reads tensors of a safetensors file by name, with pread.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::string path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const SafetensorsHeader& header() const { return header_; }
  /// `bytes` of tensor `t` starting `offset` bytes into it.
  void read(const TensorEntry& t, uint64_t offset, void* dst, size_t bytes) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  SafetensorsHeader header_;
};

}  // namespace strata::checkpoint
