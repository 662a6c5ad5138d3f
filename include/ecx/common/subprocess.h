// Subprocess: a child process with pipes to its stdin and stdout, for multi-process
// tests and benchmarks. The child sees EOF on stdin when the parent closes it or dies.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "ecx/common/deadline.h"
#include "ecx/common/status.h"

namespace ecx {

class Subprocess {
 public:
  // Starts `argv[0]` with `argv`. The child's stderr is inherited.
  static Result<Subprocess> spawn(const std::vector<std::string>& argv);
  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&& other) noexcept;
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();  // kills (SIGKILL) and reaps a child still running

  pid_t pid() const { return pid_; }
  // Reads one line (without the newline) from the child's stdout.
  Result<std::string> read_line(Deadline deadline);
  // Writes all of `text` to the child's stdin.
  Status write_stdin(std::string_view text);
  // Closes the child's stdin (a polite "stop").
  void close_stdin();
  Status kill(int signal);
  // Waits for the child to exit; returns its exit code (128 + signal if killed).
  Result<int> wait(Deadline deadline);

 private:
  Subprocess() = default;
  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  int stdout_fd_ = -1;
  std::string buffer_;  // stdout bytes read past the last line
};

// The path of this process's own binary (/proc/self/exe), for starting another copy of
// it; "ecx" (found on PATH) if that cannot be read.
std::string current_executable();

// The path of the binary `name` in the directory of this process's own binary (`ecx` and
// `ecx-bench` are installed side by side); `name` alone (found on PATH) when that
// directory cannot be read.
std::string sibling_executable(const std::string& name);

}  // namespace ecx
