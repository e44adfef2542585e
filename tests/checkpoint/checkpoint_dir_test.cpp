// Checkpoint directories: atomic replacement, and every kind of damage to a
// committed checkpoint found by verify() with a message naming the file.
#include "strata/checkpoint/checkpoint_dir.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "error_of.h"
#include "strata/core/error.h"

namespace strata::checkpoint {
namespace {
namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) {
  return (fs::temp_directory_path() / ("strata-ckdir-" + name + "-" + std::to_string(::getpid()))).string();
}

void save(const std::string& dir, const std::string& payload) {
  CheckpointWriter w(dir, "test");
  w.write_text("a.txt", payload);
  FileWriter f(w.path("b.bin"));
  std::string big(100000, 'x');
  f.write(big.data(), big.size());
  f.finish();
  w.add("b.bin", f.bytes(), f.checksum());
  w.commit();
}

TEST(CheckpointDir, CommitReplacesAtomicallyAndCleansUp) {
  const std::string root = temp_dir("commit");
  const std::string dir = root + "/ckpt";
  save(dir, "first");
  CheckpointReader r1(dir);
  r1.verify();
  EXPECT_EQ(r1.read_text("a.txt"), "first");
  save(dir, "second");
  CheckpointReader r2(dir);
  r2.verify();
  EXPECT_EQ(r2.read_text("a.txt"), "second");
  {
    CheckpointWriter abandoned(dir, "test");
    abandoned.write_text("a.txt", "third");
  }  // never committed
  EXPECT_EQ(CheckpointReader(dir).read_text("a.txt"), "second");
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(root)) entries.push_back(e.path().filename().string());
  EXPECT_EQ(entries, std::vector<std::string>{"ckpt"}) << "no temporary or previous directory left";
  fs::remove_all(root);
}

TEST(CheckpointDir, DamageIsFoundAndNamed) {
  const std::string root = temp_dir("damage");
  const std::string dir = root + "/ckpt";
  auto fresh = [&] {
    fs::remove_all(dir);
    save(dir, "payload");
  };
  auto verify = [&] { return error_of([&] { CheckpointReader(dir).verify(); }); };

  fresh();
  EXPECT_EQ(verify(), "no error");
  for (const char* file : {"a.txt", "b.bin"}) {
    fresh();
    {
      std::fstream f(dir + "/" + file, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(3);
      char c = 0;
      f.get(c);
      f.seekp(3);
      f.put(static_cast<char>(c ^ 0x10));
    }
    EXPECT_NE(verify().find(std::string(file) + " is corrupted"), std::string::npos) << verify();
    fresh();
    fs::resize_file(dir + "/" + file, 2);
    EXPECT_NE(verify().find("(truncated)"), std::string::npos) << verify();
    fresh();
    fs::remove(dir + "/" + file);
    EXPECT_NE(verify().find(std::string(file) + " is missing"), std::string::npos) << verify();
  }
  fresh();
  fs::remove(dir + "/manifest.json");
  EXPECT_NE(verify().find("has no manifest.json"), std::string::npos) << verify();
  fresh();
  {
    std::ofstream(dir + "/manifest.json") << R"({"format": "strata-checkpoint", "version": 99, "kind": "x", "files": []})";
  }
  EXPECT_NE(verify().find("version 99 is newer"), std::string::npos) << verify();
  fresh();
  {
    std::ofstream(dir + "/manifest.json") << R"({"format": "strata-checkpoint", "version": 1, "kind": "x",
      "files": [{"name": "../etc/passwd", "bytes": 1, "xxh3_64": "0000000000000000"}]})";
  }
  EXPECT_NE(verify().find("is not allowed"), std::string::npos) << verify();
  fs::remove_all(root);
}

TEST(CheckpointDir, ReaderFallsBackToPrevAfterAnInterruptedSwap) {
  const std::string root = temp_dir("prev");
  const std::string dir = root + "/ckpt";
  save(dir, "old");
  fs::rename(dir, dir + ".prev");  // what a crash between the two renames of the fallback path leaves
  CheckpointReader r(dir);
  r.verify();
  EXPECT_EQ(r.read_text("a.txt"), "old");
  fs::remove_all(root);
}

}  // namespace
}  // namespace strata::checkpoint

namespace strata::checkpoint {
namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(CheckpointDir, NeverReplacesWhatIsNotAPreviousCheckpoint) {
  const std::string root = temp_dir("users-files");
  fs::remove_all(root);
  fs::create_directories(root + "/mine/sub");
  std::ofstream(root + "/mine/report.txt") << "my results";
  std::ofstream(root + "/mine/sub/data.csv") << "1,2,3";
  std::ofstream(root + "/notes.txt") << "a file of the user's";

  std::string e = error_of([&] { save(root + "/mine", "x"); });
  EXPECT_NE(e.find("is not a strata checkpoint (no manifest.json)"), std::string::npos) << e;
  e = error_of([&] { save(root + "/notes.txt", "x"); });
  EXPECT_NE(e.find("exists and is not a checkpoint directory (it is a file)"), std::string::npos) << e;
  EXPECT_EQ(read_file(root + "/mine/report.txt"), "my results");
  EXPECT_EQ(read_file(root + "/mine/sub/data.csv"), "1,2,3");
  EXPECT_EQ(read_file(root + "/notes.txt"), "a file of the user's");
  EXPECT_NO_THROW(check_replaceable(root + "/absent"));

  // A previous checkpoint is replaced; one the user added a file to is not.
  save(root + "/ckpt", "first");
  EXPECT_NO_THROW(check_replaceable(root + "/ckpt"));
  save(root + "/ckpt", "second");
  std::ofstream(root + "/ckpt/keep-me.txt") << "mine";
  e = error_of([&] { save(root + "/ckpt", "third"); });
  EXPECT_NE(e.find("also holds keep-me.txt, which its manifest does not list"), std::string::npos) << e;
  EXPECT_EQ(read_file(root + "/ckpt/keep-me.txt"), "mine");
  EXPECT_EQ(CheckpointReader(root + "/ckpt").read_text("a.txt"), "second");

  // A sibling named like a temporary directory but not one of ours survives a save.
  fs::create_directories(root + "/run.tmp-notes");
  std::ofstream(root + "/run.tmp-notes/x.txt") << "x";
  save(root + "/run", "y");
  EXPECT_TRUE(fs::exists(root + "/run.tmp-notes/x.txt"));

  e = error_of([&] { check_writable_file(root + "/mine"); });
  EXPECT_NE(e.find("is a directory"), std::string::npos) << e;
  EXPECT_NO_THROW(check_writable_file(root + "/new/dir/w.safetensors"));
  fs::remove_all(root);
}

}  // namespace
}  // namespace strata::checkpoint
