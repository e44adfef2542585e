#pragma once
// Starting a program as a child process, for `strata run` (its ranks) and
// `strata trace record` (the traced program): one fork/exec with the
// environment it is given, one EINTR-safe wait, one way to say how it ended.

#include <sys/types.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace strata::tools {

struct ChildEnv {
  std::string name, value;
  bool overwrite = true;  // false: a value the user set already stays
};

/// fork()s; the child runs `in_child` (process group, signals, descriptors),
/// sets `env` and execs `command` (PATH searched). When the exec fails the
/// child prints "<who>cannot run <program>: <why>" on stderr and exits with
/// 127, as a shell does. Returns the child's pid; a failed fork throws
/// strata::Error, `what` saying what was being started.
pid_t spawn_child(const std::vector<std::string>& command, const std::vector<ChildEnv>& env,
                  const std::function<void()>& in_child, const char* who, const std::string& what);

/// Waits for `pid` (retrying on EINTR) and returns its wait status.
int wait_child(pid_t pid);

/// "exited with status N" or "was killed by signal N (name)".
std::string describe_exit(int status);
/// The status a shell would give: the exit status, or 128 + the signal.
int exit_code_of(int status);

}  // namespace strata::tools
