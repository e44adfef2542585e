#include "strata/checkpoint/checkpoint_dir.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "strata/core/error.h"
#include "strata/core/log.h"

namespace strata::checkpoint {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kManifest = "manifest.json";

bool plain_name(const std::string& n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos && n.find('\0') == std::string::npos;
}

uint64_t parse_hex64(const std::string& s) {
  STRATA_CHECK(s.size() == 16 && s.find_first_not_of("0123456789abcdef") == std::string::npos, "checksum \"", s,
               "\" is not 16 lower-case hex digits");
  return std::stoull(s, nullptr, 16);
}

std::string parent_of(const std::string& dir) {
  const fs::path p = fs::absolute(dir).parent_path();
  return p.empty() ? "." : p.string();
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  STRATA_CHECK(in.good(), "cannot open ", path, ": ", std::strerror(errno));
  std::ostringstream s;
  s << in.rdbuf();
  STRATA_CHECK(!in.bad(), "cannot read ", path);
  return s.str();
}

}  // namespace

const ManifestFile* Manifest::find(const std::string& name) const {
  for (const ManifestFile& f : files) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string manifest_to_json(const Manifest& m) {
  json files = json::array();
  for (const ManifestFile& f : m.files) {
    files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"xxh3_64", hex64(f.checksum)}});
  }
  return json{{"format", "strata-checkpoint"}, {"version", m.version}, {"kind", m.kind}, {"files", files}}.dump(1) +
         "\n";
}

Manifest manifest_from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    STRATA_FAIL("not JSON (", e.what(), ")");
  }
  STRATA_CHECK(j.is_object() && j.contains("format") && j["format"] == "strata-checkpoint",
               "not a strata checkpoint manifest (no \"format\": \"strata-checkpoint\")");
  STRATA_CHECK(j.contains("version") && j["version"].is_number_integer(), "the manifest has no integer version");
  Manifest m;
  m.version = j["version"].get<int>();
  STRATA_CHECK(m.version >= 1, "checkpoint version ", m.version, " is not valid");
  STRATA_CHECK(m.version <= kCheckpointVersion, "checkpoint version ", m.version,
               " is newer than this strata reads (", kCheckpointVersion, "); load it with a newer strata");
  try {
    m.kind = j.at("kind").get<std::string>();
    for (const json& f : j.at("files")) {
      ManifestFile e;
      e.name = f.at("name").get<std::string>();
      e.bytes = f.at("bytes").get<uint64_t>();
      e.checksum = parse_hex64(f.at("xxh3_64").get<std::string>());
      STRATA_CHECK(plain_name(e.name) && e.name != kManifest, "file name \"", e.name, "\" is not allowed");
      STRATA_CHECK(m.find(e.name) == nullptr, "file \"", e.name, "\" is listed twice");
      m.files.push_back(std::move(e));
    }
  } catch (const json::exception& e) {
    STRATA_FAIL("malformed manifest: ", e.what());
  }
  return m;
}

void check_replaceable(const std::string& dir) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (ec || !fs::exists(st)) return;  // nothing there: a new checkpoint
  STRATA_CHECK(fs::is_directory(st), dir, " exists and is not a checkpoint directory (it is ",
               fs::is_symlink(st) ? "a symbolic link" : "a file",
               "); a save would replace it. Choose another checkpoint path, or move it away first");
  const fs::path manifest = fs::path(dir) / kManifest;
  Manifest m;
  try {
    m = manifest_from_json(slurp(manifest.string()));
  } catch (const std::exception& e) {
    STRATA_FAIL(dir, " exists and is not a strata checkpoint (", fs::exists(manifest, ec) ? e.what() : "no manifest.json",
                "); a save replaces the whole directory, so it refuses to. Choose another checkpoint path, or "
                "move that directory away first");
  }
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    STRATA_CHECK(name == kManifest || m.find(name) != nullptr, dir, " is a checkpoint but also holds ", name,
                 ", which its manifest does not list; a save replaces the whole directory, so it refuses to. Move ",
                 name, " out of it, or choose another checkpoint path");
  }
  STRATA_CHECK(!ec, "cannot list ", dir, ": ", ec.message());
}

void check_writable_file(const std::string& path) {
  std::error_code ec;
  STRATA_CHECK(!path.empty(), "an empty path was given for a file to write");
  STRATA_CHECK(!fs::is_directory(path, ec), path, " is a directory; give the path of a file to write");
  fs::path parent = fs::absolute(path).parent_path();
  fs::create_directories(parent, ec);
  STRATA_CHECK(!ec, "cannot create ", parent.string(), " for ", path, ": ", ec.message());
  STRATA_SYSCALL(::access(parent.c_str(), W_OK), "cannot write in ", parent.string(), " (for ", path, ")");
}

CheckpointWriter::CheckpointWriter(std::string dir, std::string kind)
    : dir_(fs::absolute(dir).lexically_normal().string()) {
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  check_replaceable(dir_);
  manifest_.kind = std::move(kind);
  const fs::path parent = fs::path(dir_).parent_path();
  std::error_code ec;
  fs::create_directories(parent, ec);
  STRATA_CHECK(!ec, "cannot create ", parent.string(), ": ", ec.message());
  // Temporary directories of saves that never committed (a crash) go now:
  // <dir>.tmp-<pid> directories, nothing else.
  const std::string stale = fs::path(dir_).filename().string() + ".tmp-";
  for (const auto& e : fs::directory_iterator(parent)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(stale, 0) != 0 || name.size() == stale.size() || !e.is_directory(ec)) continue;
    if (name.find_first_not_of("0123456789", stale.size()) != std::string::npos) continue;
    fs::remove_all(e.path(), ec);
  }
  tmp_ = dir_ + ".tmp-" + std::to_string(::getpid());
  fs::create_directory(tmp_, ec);
  STRATA_CHECK(!ec, "cannot create ", tmp_, ": ", ec.message());
}

CheckpointWriter::~CheckpointWriter() {
  if (committed_) return;
  std::error_code ec;
  fs::remove_all(tmp_, ec);
}

std::string CheckpointWriter::path(const std::string& name) const {
  STRATA_CHECK(plain_name(name) && name != kManifest, "checkpoint file name \"", name, "\" is not allowed");
  return tmp_ + "/" + name;
}

void CheckpointWriter::add(const std::string& name, uint64_t bytes, uint64_t checksum) {
  STRATA_CHECK(manifest_.find(name) == nullptr, "checkpoint file \"", name, "\" added twice");
  manifest_.files.push_back({name, bytes, checksum});
}

void CheckpointWriter::write_text(const std::string& name, const std::string& text) {
  FileWriter f(path(name));
  f.write(text.data(), text.size());
  f.finish();
  add(name, f.bytes(), f.checksum());
}

void CheckpointWriter::commit() {
  STRATA_CHECK(!committed_, "checkpoint ", dir_, " committed twice");
  kill_point("before-manifest");
  {
    const std::string text = manifest_to_json(manifest_);
    FileWriter f(tmp_ + "/" + kManifest);
    f.write(text.data(), text.size());
    f.finish();
  }
  sync_directory(tmp_);
  kill_point("before-rename");
  const std::string parent = parent_of(dir_);
  check_replaceable(dir_);  // again: something may have appeared there while the checkpoint was written
  std::error_code ec;
  if (!fs::exists(dir_, ec)) {
    STRATA_SYSCALL(::rename(tmp_.c_str(), dir_.c_str()), "cannot rename ", tmp_, " to ", dir_);
  } else if (const int err = STRATA_SYSCALL_ERRNO(::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dir_.c_str(),
                                                               RENAME_EXCHANGE));
             err == 0) {
    // tmp_ now holds the previous checkpoint.
  } else {
    if (err != EINVAL && err != ENOSYS) STRATA_FAIL_ERRNO(err, "renameat2", "cannot swap ", tmp_, " with ", dir_);
    // No atomic exchange here: keep the old one as <dir>.prev until the new one is in place.
    const std::string prev = dir_ + ".prev";
    fs::remove_all(prev, ec);
    STRATA_SYSCALL(::rename(dir_.c_str(), prev.c_str()), "cannot rename ", dir_, " to ", prev);
    STRATA_SYSCALL(::rename(tmp_.c_str(), dir_.c_str()), "cannot rename ", tmp_, " to ", dir_);
    sync_directory(parent);
    fs::rename(prev, tmp_, ec);
  }
  committed_ = true;
  sync_directory(parent);
  kill_point("after-rename");
  fs::remove_all(tmp_, ec);
  if (ec) STRATA_LOG(kWarn, "could not remove the previous checkpoint at {}: {}", tmp_, ec.message());
}

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  std::error_code ec;
  if (!fs::exists(dir_, ec) && fs::exists(dir_ + ".prev", ec)) {
    STRATA_LOG(kWarn, "{} is missing but {}.prev is complete: a save was interrupted while swapping; reading {}.prev",
               dir_, dir_, dir_);
    dir_ += ".prev";
  }
  STRATA_CHECK(fs::is_directory(dir_, ec), "checkpoint ", dir_, " does not exist or is not a directory");
  const std::string path = dir_ + "/" + kManifest;
  STRATA_CHECK(fs::exists(path, ec), "checkpoint ", dir_, " has no ", kManifest,
               ": it is not a strata checkpoint, or its save never finished");
  try {
    manifest_ = manifest_from_json(slurp(path));
  } catch (const Error& e) {
    STRATA_FAIL(path, ": ", e.what());
  }
}

void CheckpointReader::verify() const {
  std::vector<std::string> all;
  for (const ManifestFile& f : manifest_.files) all.push_back(f.name);
  verify(all);
}

void CheckpointReader::verify(const std::vector<std::string>& names) const {
  for (const std::string& name : names) {
    STRATA_CHECK(has(name), "checkpoint ", dir_, " has no ", name, " in its manifest");
    const ManifestFile& f = *manifest_.find(name);
    const std::string p = dir_ + "/" + f.name;
    std::error_code ec;
    STRATA_CHECK(fs::exists(p, ec), "checkpoint file ", p, " is missing");
    const FileDigest d = digest_file(p);
    STRATA_CHECK(d.bytes == f.bytes, "checkpoint file ", p, " is ", d.bytes, " bytes, the manifest says ", f.bytes,
                 d.bytes < f.bytes ? " (truncated)" : "");
    STRATA_CHECK(d.checksum == f.checksum, "checkpoint file ", p, " is corrupted: checksum ", hex64(d.checksum),
                 ", the manifest says ", hex64(f.checksum));
  }
}

std::string CheckpointReader::path(const std::string& name) const {
  STRATA_CHECK(has(name), "checkpoint ", dir_, " has no ", name, " in its manifest");
  return dir_ + "/" + name;
}

std::string CheckpointReader::read_text(const std::string& name) const {
  const std::string p = path(name);
  std::string text = slurp(p);
  const ManifestFile& f = *manifest_.find(name);
  STRATA_CHECK(text.size() == f.bytes && XXH3_64bits(text.data(), text.size()) == f.checksum, "checkpoint file ", p,
               " does not match its manifest entry (corrupted or truncated)");
  return text;
}

}  // namespace strata::checkpoint
