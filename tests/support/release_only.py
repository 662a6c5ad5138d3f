"""Which tests the release tree runs in scripts/test: those the sanitizer tree did not pass
(absent there, such as the multihost and install tests, or skipped under a sanitizer, such
as the EMFILE test). Prints them as `ctest -I` wants them: 0,0,0,N1,N2,... (release
numbers), one per line on stderr by name.

    python3 tests/support/release_only.py BUILD SANITIZER_CTEST_OUTPUT
"""
import re
import subprocess
import sys


def numbered(build: str) -> dict[str, int]:
    out = subprocess.run(["ctest", "-N"], cwd=build, check=True, capture_output=True,
                         text=True).stdout
    return {m.group(2): int(m.group(1)) for m in re.finditer(r"Test\s+#(\d+): (\S+)", out)}


def passed(ctest_output: str) -> set[str]:
    with open(ctest_output, errors="replace") as f:
        text = f.read()
    return {m.group(1) for m in re.finditer(r"Test\s+#\d+: (\S+) .*\s+Passed\s", text)}


def main() -> int:
    build, log = sys.argv[1], sys.argv[2]
    done = passed(log)
    if not done:
        print(f"release_only: no passed test in {log}", file=sys.stderr)
        return 1
    left = sorted((n, name) for name, n in numbered(build).items() if name not in done)
    for _, name in left:
        print(f"  {name}", file=sys.stderr)
    print(",".join(["0", "0", "0"] + [str(n) for n, _ in left]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
