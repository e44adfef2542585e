// `strata run`: starts the ranks of a job on this node, as torchrun does.
//
//   strata run -n N [--nnodes M --node-rank K --master-addr A --master-port P] [--grace S] -- PROGRAM ARGS...
//
// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
// and MASTER_PORT (and the GROUP_RANK/ROLE_RANK torchrun sets too), its
// stdout and stderr are read line by line and printed prefixed with
// "[rank R] ". When a rank exits with a non-zero status or a signal, the others
// are sent SIGTERM, then SIGKILL after --grace seconds, and strata run exits
// with that rank's status (128 + signal), naming the rank. A single-node job
// picks a free port unless --master-port says one.
//
// Note [Threads per rank]
// Each rank's LibTorch (OpenMP) and strata kernels (kernels/thread_pool.cpp)
// size their thread pools by the machine's cores, so N ranks on one node
// would run N x cores threads of each. With OpenMP's spinning waits
// (LibTorch 2.x) that is not merely wasteful: on 2 cores, 8 ranks of the GPT
// example trained 3.7x slower (33 s against 9 s). So each of N local ranks
// gets max(1, cores / N) threads, the cores shared out (torchrun sets 1), as
// OMP_NUM_THREADS and STRATA_NUM_THREADS where the environment does not set
// them already. The launcher's first line says what it chose.
//
// Note [Ranks are process groups]
// Each rank runs in a process group of its own, and every signal the launcher
// sends goes to the whole group: a rank started through a wrapper script, or
// one that starts helpers, is stopped with all its processes, and a helper
// that still holds the rank's output cannot keep the launcher waiting past
// --grace (its pipe is closed then). SIGINT, SIGTERM and SIGHUP sent to the
// launcher are passed on to every rank's group the same way. When starting
// the ranks fails half way (no more file descriptors, no more processes), the
// groups already started are killed and reaped before the error is reported.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "port_hold.h"
#include "commands.h"
#include "strata/core/error.h"

namespace strata::tools {
namespace {

struct RunOptions {
  int nproc = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port (single node)
  double grace = 5.0;
  std::vector<std::string> command;
  std::FILE* out = stdout;  // where the ranks' prefixed lines and the launcher's own go
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  int out = -1;  // read end of its stdout+stderr pipe
  std::string partial;
  bool running = true;
  int status = 0;
};

void print_lines(std::FILE* out, Rank& r, const char* data, size_t n) {
  r.partial.append(data, n);
  size_t start = 0;
  for (size_t nl; (nl = r.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    fmt::print(out, "[rank {}] {}\n", r.rank, std::string_view(r.partial).substr(start, nl - start));
  }
  r.partial.erase(0, start);
  std::fflush(out);
}

volatile std::sig_atomic_t g_launcher_signal = 0;
void on_launcher_signal(int sig) { g_launcher_signal = sig; }

// Sends `sig` to every process of rank `r`'s group (Note [Ranks are process groups]).
void signal_group(const Rank& r, int sig) {
  if (r.pid > 0) ::kill(-r.pid, sig);
}

// Starting failed half way: every group started so far is killed and reaped.
void kill_started(std::vector<Rank>& ranks) {
  for (Rank& r : ranks) {
    if (r.pid <= 0) continue;
    signal_group(r, SIGKILL);
    wait_child(r.pid);
    if (r.out >= 0) ::close(r.out);
  }
}

pid_t start_rank(const RunOptions& o, Rank& r, int local, int world, int port, int threads) {
  int fds[2];
  const int err = STRATA_SYSCALL_ERRNO(::pipe2(fds, O_CLOEXEC));
  if (err != 0) {
    STRATA_FAIL_ERRNO(err, "pipe2", "cannot start rank ", r.rank,
                      err == EMFILE || err == ENFILE ? " (raise ulimit -n or start fewer ranks)" : "");
  }
  std::vector<ChildEnv> env = {
      {"RANK", std::to_string(r.rank)},          {"WORLD_SIZE", std::to_string(world)},
      {"LOCAL_RANK", std::to_string(local)},     {"LOCAL_WORLD_SIZE", std::to_string(o.nproc)},
      {"GROUP_RANK", std::to_string(o.node_rank)}, {"ROLE_RANK", std::to_string(r.rank)},
      {"MASTER_ADDR", o.master_addr},            {"MASTER_PORT", std::to_string(port)}};
  if (threads > 0) {  // Note [Threads per rank]: the user's own settings win
    env.push_back({"OMP_NUM_THREADS", std::to_string(threads), false});
    env.push_back({"STRATA_NUM_THREADS", std::to_string(threads), false});
  }
  pid_t pid = -1;
  try {
    pid = spawn_child(o.command, env, [&] {
      ::setpgid(0, 0);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::signal(SIGHUP, SIG_DFL);
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(fds[1], STDERR_FILENO);
    }, "", fmt::format("rank {}", r.rank));
  } catch (...) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw;
  }
  ::setpgid(pid, pid);  // as the child does: whichever runs first, the group exists before any signal
  ::close(fds[1]);
  r.out = fds[0];
  return pid;
}

int run_ranks(const RunOptions& o) {
  STRATA_CHECK(!o.command.empty(), "give the program after --, e.g. strata run -n 2 -- build/examples/gpt");
  STRATA_CHECK(o.nproc >= 1 && o.nnodes >= 1 && o.node_rank >= 0 && o.node_rank < o.nnodes,
               "-n must be at least 1 and --node-rank below --nnodes");
  STRATA_CHECK(o.nnodes == 1 || o.master_port > 0, "a multi-node job needs the same --master-port on every node");
  std::optional<PortHold> held;  // Note [A port held for the job]: until every rank has exited
  if (o.master_port == 0) held.emplace();
  const int port = held ? held->port() : o.master_port;
  const int world = o.nproc * o.nnodes;
  // Note [Threads per rank]: 0 with one rank, which keeps the whole machine.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = o.nproc > 1 ? std::max(1, cores / o.nproc) : 0;
  std::vector<Rank> ranks(o.nproc);
  g_launcher_signal = 0;
  struct sigaction forward {};
  forward.sa_handler = on_launcher_signal;
  struct sigaction old_int {}, old_term {}, old_hup {};
  ::sigaction(SIGINT, &forward, &old_int);
  ::sigaction(SIGTERM, &forward, &old_term);
  ::sigaction(SIGHUP, &forward, &old_hup);
  struct Restore {  // the launcher's own handlers come back however it returns
    struct sigaction i, t, h;
    ~Restore() {
      ::sigaction(SIGINT, &i, nullptr);
      ::sigaction(SIGTERM, &t, nullptr);
      ::sigaction(SIGHUP, &h, nullptr);
    }
  } restore{old_int, old_term, old_hup};
  try {
    for (int i = 0; i < o.nproc; ++i) {
      ranks[i].rank = o.node_rank * o.nproc + i;
      ranks[i].pid = start_rank(o, ranks[i], i, world, port, threads);
    }
  } catch (...) {
    kill_started(ranks);
    throw;
  }
  fmt::print(o.out, "strata run: {} ranks ({} on this node), MASTER_ADDR={} MASTER_PORT={}{}\n", world, o.nproc,
             o.master_addr, port,
             threads > 0 ? fmt::format(", {} thread{} per rank of {} cores", threads, threads == 1 ? "" : "s", cores) : "");
  std::fflush(stdout);

  int exit_code = 0;
  const Rank* failed = nullptr;
  bool stopping = false;
  const auto grace = std::chrono::milliseconds(static_cast<int64_t>(o.grace * 1000));
  const auto stop_all = [&](int sig) {  // the groups that may still have processes
    for (const Rank& r : ranks) {
      if (r.running || r.out >= 0) signal_group(r, sig);
    }
  };
  std::chrono::steady_clock::time_point kill_at{}, close_at{};
  bool killed = false;
  char buf[65536];
  for (;;) {
    if (g_launcher_signal != 0 && !stopping) {
      const int sig = g_launcher_signal;
      fmt::print(stderr, "strata run: received signal {} ({}); passing it to every rank\n", sig, strsignal(sig));
      stop_all(sig);
      stopping = true;
      exit_code = 128 + sig;
      kill_at = std::chrono::steady_clock::now() + grace;
    }
    std::vector<pollfd> fds;
    for (Rank& r : ranks) {
      if (r.out >= 0) fds.push_back({r.out, POLLIN, 0});
    }
    if (!fds.empty()) {
      ::poll(fds.data(), fds.size(), 100);
    } else {
      ::usleep(20000);  // output closed, ranks still running
    }
    for (Rank& r : ranks) {
      if (r.out < 0) continue;
      bool ready = false;
      for (const pollfd& p : fds) ready = ready || (p.fd == r.out && p.revents != 0);
      if (!ready) continue;
      const ssize_t n = ::read(r.out, buf, sizeof buf);
      if (n > 0) {
        print_lines(o.out, r, buf, static_cast<size_t>(n));
      } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        if (!r.partial.empty()) print_lines(o.out, r, "\n", 1);
        ::close(r.out);
        r.out = -1;
      }
    }
    // Reap ranks that ended.
    for (Rank& r : ranks) {
      if (!r.running) continue;
      int status = 0;
      if (::waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
      r.running = false;
      r.status = status;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && failed == nullptr && !stopping) {
        failed = &r;
        exit_code = exit_code_of(status);
        fmt::print(stderr, "strata run: rank {} {}; stopping the other ranks\n", r.rank, describe_exit(status));
        stop_all(SIGTERM);
        stopping = true;
        kill_at = std::chrono::steady_clock::now() + grace;
      }
    }
    bool any_running = false, any_open = false;
    for (const Rank& r : ranks) {
      any_running = any_running || r.running;
      any_open = any_open || r.out >= 0;
    }
    if (!any_running && !any_open) break;
    const auto now = std::chrono::steady_clock::now();
    if (!any_running && !stopping) {
      // Every rank exited but a helper of one still holds its output: it gets
      // --grace to finish, then its group is stopped like a failed job's.
      stopping = true;
      kill_at = now + grace;
    }
    if (stopping && !killed && now > kill_at) {
      stop_all(SIGKILL);
      killed = true;
      close_at = now + std::chrono::seconds(1);
    }
    if (killed && !any_running && now > close_at) {
      // A process outside the groups (one that called setsid) still holds a
      // pipe: stop reading it rather than wait for it.
      for (Rank& r : ranks) {
        if (r.out < 0) continue;
        if (!r.partial.empty()) print_lines(o.out, r, "\n", 1);
        ::close(r.out);
        r.out = -1;
      }
    }
  }
  if (failed != nullptr) {
    fmt::print(stderr, "strata run: failed: rank {} (exit code {})\n", failed->rank, exit_code);
  }
  return exit_code;
}

}  // namespace

int run_local_ranks(int n, const std::vector<std::string>& command) {
  RunOptions o;
  o.nproc = n;
  o.command = command;
  o.out = stderr;  // the caller's stdout stays its own (a report, JSON)
  return run_ranks(o);
}

void add_run_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("run", "Start the ranks of a distributed job on this node (torchrun's variables)");
  auto o = std::make_shared<RunOptions>();
  cmd->add_option("-n,--nproc-per-node", o->nproc, "ranks on this node")->required();
  cmd->add_option("--nnodes", o->nnodes, "nodes in the job");
  cmd->add_option("--node-rank", o->node_rank, "this node's index");
  cmd->add_option("--master-addr", o->master_addr, "address of rank 0's node");
  cmd->add_option("--master-port", o->master_port, "port of the rendezvous store (default: a free one, one node)");
  cmd->add_option("--grace", o->grace, "seconds between SIGTERM and SIGKILL for the others when a rank fails");
  cmd->add_option("command", o->command, "the program and its arguments, after --")->required();
  cmd->callback([o] {
    const int code = run_ranks(*o);
    if (code != 0) std::exit(code);
  });
}

}  // namespace strata::tools
