"""What the release tree runs in scripts/test: the tests the sanitizer tree did not run for
a reason of its own (absent there, such as the multihost and install tests, or skipped
because of the sanitizer, such as the EMFILE test), and the test binaries it must build for
them.

    python3 tests/support/release_only.py BUILD SANITIZER_JUNIT
        prints the tests as `ctest -I` wants them: 0,0,0,N1,N2,... (BUILD's numbers), and
        their names, one per line, on stderr. A test binary BUILD did not build (its
        `<binary>_NOT_BUILT` placeholder) is left out.
    python3 tests/support/release_only.py --targets SANITIZER_BUILD SANITIZER_JUNIT
        prints the test binaries (their ctest label: one per ecx_test binary) that hold the
        tests the sanitizer tree ran but did not pass: what the release tree must build
        besides ecx, ecx-bench and libecx.

SANITIZER_JUNIT is the sanitizer tree's `ctest --output-junit` report. A test it skipped
is run again only if its skip message names a sanitizer (GTEST_SKIP() << "... sanitizer
..."), or if the message cannot be read there (the report keeps only the head of a test's
output): a test skipped for another reason (no GPU, a connector the case does not apply
to) would be skipped in the release tree too.
"""
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree


def ctest(build: str, *args: str) -> str:
    return subprocess.run(["ctest", *args], cwd=build, check=True, capture_output=True,
                          text=True).stdout


def numbered(build: str) -> dict[str, int]:
    return {m.group(2): int(m.group(1))
            for m in re.finditer(r"Test\s+#(\d+): (\S+)", ctest(build, "-N"))
            if not m.group(2).endswith("_NOT_BUILT")}


def done_there(junit: str) -> set[str]:
    """The tests the sanitizer tree passed, or skipped for a reason the release tree shares."""
    done = set()
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "").split()[0]
        if case.get("status") == "run" and case.find("failure") is None:
            done.add(name)
        elif case.find("skipped") is not None:
            out = case.findtext("system-out") or ""
            reason = out.split(": Skipped\n", 1)[1] if ": Skipped\n" in out else None
            if reason is not None and "sanitizer" not in reason.lower():
                done.add(name)
    return done


def binaries(build: str, names: set[str]) -> list[str]:
    """The labels of the tests `names` in `build` that name a test binary (an executable of
    the tree: ecx_test labels each test with its binary's name)."""
    out = set()
    for test in json.loads(ctest(build, "--show-only=json-v1"))["tests"]:
        if test["name"].split()[0] not in names:
            continue
        command = test.get("command") or [""]
        for prop in test.get("properties", []):
            if prop["name"] == "LABELS":
                out.update(label for label in prop["value"] if command[0].endswith("/" + label))
    return sorted(out)


def main() -> int:
    targets = sys.argv[1] == "--targets"
    build, log = sys.argv[2:4] if targets else sys.argv[1:3]
    done = done_there(log)
    if not done:
        print(f"release_only: no passed test in {log}", file=sys.stderr)
        return 1
    left = sorted((n, name) for name, n in numbered(build).items() if name not in done)
    if targets:
        print(" ".join(binaries(build, {name for _, name in left})))
        return 0
    for _, name in left:
        print(f"  {name}", file=sys.stderr)
    print(",".join(["0", "0", "0"] + [str(n) for n, _ in left]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
