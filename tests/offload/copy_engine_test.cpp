// CopyEngine (offload/copy_engine.h): jobs run on its workers, in the order
// submitted, up to one per worker at once; a ticket rethrows its job's error;
// the counts say what is queued and running; destruction runs what is queued.
#include "strata/offload/copy_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "strata/core/error.h"

namespace strata::offload {
namespace {

// A gate jobs wait at until the test opens it.
class Gate {
 public:
  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void pass() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

bool eventually(const std::function<bool()>& cond) {
  for (int i = 0; i < 2000; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return cond();
}

TEST(CopyEngine, JobsRunOnWorkersAndTicketsRethrowTheirErrors) {
  CopyEngine engine(2);
  std::thread::id ran_on;
  CopyTicket ok = engine.submit([&] { ran_on = std::this_thread::get_id(); });
  CopyEngine::wait(ok);
  EXPECT_NE(ran_on, std::this_thread::get_id()) << "a job runs on a worker, not the caller";
  EXPECT_TRUE(CopyEngine::test(ok));
  CopyTicket bad = engine.submit([] { STRATA_FAIL("disk gone while moving chunk 7"); });
  try {
    CopyEngine::wait(bad);
    FAIL() << "the job's error was lost";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("disk gone while moving chunk 7"), std::string::npos) << e.message();
  }
  EXPECT_THROW(CopyEngine::wait(bad), Error) << "every wait on a failed ticket throws";
  CopyEngine::wait(engine.submit([] {}));  // a failed job does not stop the worker
}

TEST(CopyEngine, CountsSayWhatIsQueuedAndRunningAndOneWorkerKeepsOrder) {
  CopyEngine engine(1);
  Gate gate;
  std::vector<int> order;
  std::mutex mu;
  std::vector<CopyTicket> tickets;
  tickets.push_back(engine.submit([&] { gate.pass(); }));
  for (int i = 0; i < 3; ++i) {
    tickets.push_back(engine.submit([&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
    }));
  }
  ASSERT_TRUE(eventually([&] { return engine.queued() == 3; })) << "queued " << engine.queued();
  EXPECT_EQ(engine.in_flight(), 4u) << "three queued and one running";
  EXPECT_FALSE(CopyEngine::test(tickets[0]));
  EXPECT_FALSE(CopyEngine::test(tickets[3]));
  gate.open();
  for (const CopyTicket& t : tickets) CopyEngine::wait(t);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2})) << "one worker runs jobs in the order submitted";
  EXPECT_TRUE(eventually([&] { return engine.in_flight() == 0; }));
}

TEST(CopyEngine, WorkersRunJobsSideBySide) {
  CopyEngine engine(2);
  // Each job waits for the other to start: only two workers at once can see
  // each other (the deadline only keeps a serial engine from hanging the test).
  std::atomic<int> started{0}, met{0};
  auto job = [&] {
    started += 1;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (started.load() < 2 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    if (started.load() == 2) met += 1;
  };
  CopyTicket a = engine.submit(job), b = engine.submit(job);
  CopyEngine::wait(a);
  CopyEngine::wait(b);
  EXPECT_EQ(started.load(), 2);
  EXPECT_EQ(met.load(), 2) << "the jobs ran one after the other";
}

TEST(CopyEngine, DestructionRunsEveryQueuedJob) {
  std::atomic<int> ran{0};
  Gate gate;
  std::thread opener;
  {
    CopyEngine engine(1);
    engine.submit([&] {
      gate.pass();
      ran += 1;
    });
    for (int i = 0; i < 5; ++i) engine.submit([&] { ran += 1; });
    opener = std::thread([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      gate.open();
    });
  }  // the destructor waits for all six
  EXPECT_EQ(ran.load(), 6);
  opener.join();
}

TEST(CopyEngine, NeedsAThread) { EXPECT_THROW(CopyEngine(0), Error); }

}  // namespace
}  // namespace strata::offload
