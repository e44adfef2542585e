#include "child_process.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>

#include "strata/core/error.h"

namespace strata::tools {

pid_t spawn_child(const std::vector<std::string>& command, const std::vector<ChildEnv>& env,
                  const std::function<void()>& in_child, const char* who, const std::string& what) {
  STRATA_CHECK(!command.empty(), "no program to run for ", what);
  // Built before the fork: the child only sets, execs and reports.
  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = STRATA_SYSCALL(::fork(), "cannot start ", what);
  if (pid == 0) {
    if (in_child) in_child();
    for (const ChildEnv& e : env) ::setenv(e.name.c_str(), e.value.c_str(), e.overwrite ? 1 : 0);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "%scannot run %s: %s\n", who, argv[0], std::strerror(errno));
    ::_exit(127);
  }
  return pid;
}

int wait_child(pid_t pid) {
  int status = 0;
  STRATA_SYSCALL(::waitpid(pid, &status, 0), "cannot wait for process ", pid);
  return status;
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
}

int exit_code_of(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

}  // namespace strata::tools
