#pragma once
// A checkpoint directory: data files plus manifest.json, which lists every
// file with its size and XXH3-64 checksum and is written last.
//
// Note [Atomic checkpoint directories]
// CheckpointWriter builds the checkpoint in a sibling temporary directory
// (<dir>.tmp-<pid>), fsyncs every file as it is finished, writes the manifest,
// fsyncs it and the temporary directory, and only then puts it in place: by
// renameat2(RENAME_EXCHANGE) when <dir> exists (one atomic swap of the old
// and new checkpoints; the old is then removed) or a plain rename when it does
// not, followed by an fsync of the parent. A crash at any point before the
// swap leaves <dir> untouched (and a temporary directory the next save
// removes); after it, <dir> is the new checkpoint. On a filesystem without
// RENAME_EXCHANGE the old checkpoint is first renamed to <dir>.prev, and
// CheckpointReader falls back to <dir>.prev when <dir> is missing, so there
// too a reader finds one complete checkpoint. One writer per <dir> at a time.
// Only a previous checkpoint is ever replaced: the writer refuses, before it
// writes anything and again before the swap, a <dir> that is a file, or a
// directory without a manifest or with files its manifest does not list
// (check_replaceable), so a mistyped path never deletes a user's files.
//
// CheckpointReader reads the manifest and verify() re-reads every listed file
// and compares size and checksum, so a truncated, corrupted or missing file
// is an Error naming it before anything is loaded.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "strata/checkpoint/files.h"

namespace strata::checkpoint {

constexpr int kCheckpointVersion = 1;

struct ManifestFile {
  std::string name;
  uint64_t bytes = 0;
  uint64_t checksum = 0;  // XXH3-64
};

struct Manifest {
  int version = kCheckpointVersion;
  std::string kind;  // what wrote it, e.g. "strata-engine"
  std::vector<ManifestFile> files;
  const ManifestFile* find(const std::string& name) const;
};

std::string manifest_to_json(const Manifest& m);
/// Throws an Error naming the problem: not JSON, not a strata checkpoint, a
/// newer version, a malformed or duplicate entry, a name that is not a plain
/// file name.
Manifest manifest_from_json(const std::string& text);

/// Throws an Error saying what to change unless a save may put a checkpoint
/// at `dir`: `dir` does not exist, or it is a checkpoint directory a previous
/// save wrote (its manifest.json parses) holding nothing but the files its
/// manifest lists. A user's file, or a directory with files of the user's
/// own, is never replaced (Note [Atomic checkpoint directories]).
void check_replaceable(const std::string& dir);

/// Throws an Error saying what to change unless a single file can be written
/// at `path` (a weight export): not a directory, and its parent directory
/// exists or can be created and is writable.
void check_writable_file(const std::string& path);

class CheckpointWriter {
 public:
  /// Starts a checkpoint that will replace `dir` on commit(); check_replaceable(dir) first.
  CheckpointWriter(std::string dir, std::string kind);
  /// Without commit(): removes the temporary directory; `dir` is untouched.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  /// Where file `name` goes (in the temporary directory).
  std::string path(const std::string& name) const;
  /// The temporary directory itself: other processes writing parts of the
  /// same checkpoint put their files there, and this writer add()s them
  /// (a shared filesystem across nodes).
  const std::string& staging_dir() const { return tmp_; }
  /// Records a finished file (its writer's size and checksum).
  void add(const std::string& name, uint64_t bytes, uint64_t checksum);
  /// Writes a small text file and records it.
  void write_text(const std::string& name, const std::string& text);
  /// Manifest, fsyncs, atomic swap (Note [Atomic checkpoint directories]).
  void commit();

 private:
  std::string dir_, tmp_;
  Manifest manifest_;
  bool committed_ = false;
};

class CheckpointReader {
 public:
  /// Reads and checks the manifest of `dir` (or of <dir>.prev when `dir` is
  /// missing after an interrupted swap).
  explicit CheckpointReader(std::string dir);
  const Manifest& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }
  /// Every listed file: present, of its size, with its checksum.
  void verify() const;
  /// The same for the listed files `names` only.
  void verify(const std::vector<std::string>& names) const;
  /// The path of a listed file; an Error when the manifest does not list it.
  std::string path(const std::string& name) const;
  bool has(const std::string& name) const { return manifest_.find(name) != nullptr; }
  /// A listed small file's contents, checked against the manifest.
  std::string read_text(const std::string& name) const;

 private:
  std::string dir_;
  Manifest manifest_;
};

}  // namespace strata::checkpoint
