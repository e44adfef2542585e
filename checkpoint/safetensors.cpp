#include "strata/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "strata/core/error.h"

namespace strata::checkpoint {

using json = nlohmann::json;

uint64_t TensorEntry::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

size_t dtype_bytes(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2},
                                                      {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},
                                                      {"U8", 1},  {"BOOL", 1}};
  const auto it = sizes.find(dtype);
  STRATA_CHECK(it != sizes.end(), "unknown safetensors dtype \"", dtype, "\"");
  return it->second;
}

const TensorEntry* SafetensorsHeader::find(const std::string& name) const {
  const auto it = index.find(name);
  return it == index.end() ? nullptr : &tensors[it->second];
}

SafetensorsHeader parse_safetensors_header(const std::string& text, uint64_t data_bytes) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    STRATA_FAIL("the safetensors header is not JSON (", e.what(), ")");
  }
  STRATA_CHECK(j.is_object(), "the safetensors header is not a JSON object");
  SafetensorsHeader h;
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      STRATA_CHECK(v.is_object(), "__metadata__ is not an object");
      for (const auto& [k, m] : v.items()) {
        STRATA_CHECK(m.is_string(), "__metadata__ value of \"", k, "\" is not a string");
        h.metadata[k] = m.get<std::string>();
      }
      continue;
    }
    STRATA_CHECK(v.is_object(), "tensor \"", name, "\": not an object");
    const auto dtype = v.find("dtype");
    const auto shape = v.find("shape");
    const auto offsets = v.find("data_offsets");
    STRATA_CHECK(dtype != v.end() && dtype->is_string(), "tensor \"", name, "\": no dtype string");
    STRATA_CHECK(shape != v.end() && shape->is_array(), "tensor \"", name, "\": no shape array");
    STRATA_CHECK(offsets != v.end() && offsets->is_array() && offsets->size() == 2, "tensor \"", name,
                 "\": data_offsets is not [begin, end]");
    TensorEntry t;
    t.name = name;
    t.dtype = dtype->get<std::string>();
    const size_t esize = dtype_bytes(t.dtype);
    uint64_t numel = 1;
    for (const json& d : *shape) {
      STRATA_CHECK(d.is_number_unsigned(), "tensor \"", name, "\": a dimension is not a non-negative integer");
      const uint64_t dim = d.get<uint64_t>();
      STRATA_CHECK(dim < (1ull << 62) && (dim == 0 || numel <= (1ull << 62) / dim), "tensor \"", name,
                   "\": shape too large");
      numel *= dim;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    for (const json& o : *offsets) {
      STRATA_CHECK(o.is_number_unsigned(), "tensor \"", name, "\": an offset is not a non-negative integer");
    }
    t.begin = (*offsets)[0].get<uint64_t>();
    t.end = (*offsets)[1].get<uint64_t>();
    STRATA_CHECK(t.begin <= t.end && t.end <= data_bytes, "tensor \"", name, "\": bytes [", t.begin, ", ", t.end,
                 ") lie outside the ", data_bytes, "-byte data section (truncated file?)");
    STRATA_CHECK(numel <= UINT64_MAX / esize && t.end - t.begin == numel * esize, "tensor \"", name, "\": ",
                 t.end - t.begin, " bytes for ", numel, " elements of ", t.dtype);
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) { return a.begin < b.begin || (a.begin == b.begin && a.end < b.end); });
  for (size_t i = 1; i < h.tensors.size(); ++i) {
    STRATA_CHECK(h.tensors[i].begin >= h.tensors[i - 1].end, "tensors \"", h.tensors[i - 1].name, "\" and \"",
                 h.tensors[i].name, "\" overlap");
  }
  for (size_t i = 0; i < h.tensors.size(); ++i) h.index.emplace(h.tensors[i].name, i);
  return h;
}

namespace {

// The header length from the first 8 bytes, checked against the file's size.
uint64_t header_length(const uint8_t* first8, uint64_t file_size) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | first8[i];
  STRATA_CHECK(n <= kMaxHeaderBytes && n <= file_size - 8, "header length ", n, " does not fit the ", file_size,
               "-byte file (truncated, or not a safetensors file)");
  return n;
}

}  // namespace

SafetensorsHeader parse_safetensors_file(const void* data, size_t size) {
  STRATA_CHECK(size >= 8, size, " bytes: too short for a safetensors file");
  const auto* bytes = static_cast<const uint8_t*>(data);
  const uint64_t n = header_length(bytes, size);
  SafetensorsHeader h = parse_safetensors_header(std::string(reinterpret_cast<const char*>(bytes) + 8, n), size - 8 - n);
  h.data_start = 8 + n;
  return h;
}

SafetensorsWriter::SafetensorsWriter(std::string path, const std::vector<Spec>& tensors,
                                     const std::map<std::string, std::string>& metadata)
    : file_(std::move(path)) {
  json j = json::object();
  if (!metadata.empty()) j["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const Spec& s : tensors) {
    STRATA_CHECK(!s.name.empty() && s.name != "__metadata__" && !j.contains(s.name), "tensor name \"", s.name,
                 "\" is empty, reserved or repeated");
    uint64_t numel = 1;
    for (int64_t d : s.shape) {
      STRATA_CHECK(d >= 0, "tensor \"", s.name, "\" has a negative dimension");
      numel *= static_cast<uint64_t>(d);
    }
    const uint64_t end = offset + numel * dtype_bytes(s.dtype);
    j[s.name] = {{"dtype", s.dtype}, {"shape", s.shape}, {"data_offsets", {offset, end}}};
    ends_.push_back(end);
    offset = end;
  }
  std::string header = j.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  file_.write(length, sizeof length);
  file_.write(header.data(), header.size());
}

void SafetensorsWriter::append(const void* data, size_t bytes) {
  const uint64_t total = ends_.empty() ? 0 : ends_.back();
  STRATA_CHECK(written_ + bytes <= total, file_.path(), ": ", written_ + bytes, " bytes appended, more than the ",
               total, " its tensors declare");
  file_.write(data, bytes);
  written_ += bytes;
}

void SafetensorsWriter::finish() {
  const uint64_t total = ends_.empty() ? 0 : ends_.back();
  STRATA_CHECK(written_ == total, file_.path(), ": ", written_, " of the ", total, " declared bytes written");
  file_.finish();
}

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)) {
  fd_ = STRATA_SYSCALL(::open(path_.c_str(), O_RDONLY | O_CLOEXEC), "cannot open ", path_);
  try {
    struct stat st {};
    STRATA_SYSCALL(::fstat(fd_, &st), "cannot stat ", path_);
    const auto size = static_cast<uint64_t>(st.st_size);
    STRATA_CHECK(size >= 8, path_, " is ", size, " bytes: too short for a safetensors file");
    uint8_t length[8];
    read_exact(fd_, path_, 0, length, sizeof length);
    try {
      const uint64_t n = header_length(length, size);
      std::string text(n, '\0');
      read_exact(fd_, path_, 8, text.data(), n);
      header_ = parse_safetensors_header(text, size - 8 - n);
      header_.data_start = 8 + n;
    } catch (const Error& e) {
      STRATA_FAIL(path_, ": ", e.what());
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsReader::read(const TensorEntry& t, uint64_t offset, void* dst, size_t bytes) const {
  STRATA_CHECK(offset + bytes <= t.end - t.begin, path_, ": read past the end of tensor \"", t.name, "\"");
  read_exact(fd_, path_, header_.data_start + t.begin + offset, dst, bytes);
}

}  // namespace strata::checkpoint
