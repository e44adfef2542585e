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
