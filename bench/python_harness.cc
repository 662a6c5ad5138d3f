#include "python_harness.h"

#include "ecx/common/subprocess.h"

namespace ecx::bench {

namespace fs = std::filesystem;

Result<PythonHarness> find_python_harness(const std::string& script, const std::string& venv_hint,
                                          const std::string& venv_holds) {
  const fs::path relative = fs::path("bench/python") / script;
  std::error_code ec;
  for (fs::path start : {fs::path(current_executable()).parent_path(), fs::current_path(ec)}) {
    for (fs::path dir = start; !dir.empty(); dir = dir.parent_path()) {
      if (fs::exists(dir / relative, ec)) {
        fs::path venv = venv_hint.empty() ? dir / ".venv" : fs::path(venv_hint);
        if (!fs::exists(venv / "bin/python", ec)) {
          return Unavailable("no Python environment at " + venv.string() + " (scripts/deps makes " +
                             venv_holds + "; or pass --venv DIR)");
        }
        return PythonHarness{venv / "bin/python", dir / relative};
      }
      if (dir == dir.parent_path()) break;
    }
  }
  return Unavailable(relative.string() + " not found above " + current_executable());
}

}  // namespace ecx::bench
