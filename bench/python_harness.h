// Where a script of the Python harness (bench/python/) runs: the project venv's python.
#pragma once

#include <filesystem>
#include <string>

#include "ecx/common/status.h"

namespace ecx::bench {

struct PythonHarness {
  std::filesystem::path python;  // VENV/bin/python
  std::filesystem::path script;  // .../bench/python/<script>
};

// bench/python/`script` in the first directory above the binary (or the working
// directory) that has it, run by `venv_hint`'s python, else by that directory's .venv.
// `venv_holds` says what the venv must hold, for the error when it is missing.
Result<PythonHarness> find_python_harness(const std::string& script, const std::string& venv_hint,
                                          const std::string& venv_holds);

}  // namespace ecx::bench
