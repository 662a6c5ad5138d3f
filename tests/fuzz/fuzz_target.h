// Shared by every fuzz target in tests/fuzz: the libFuzzer entry point and the one way a
// target reports a broken invariant. A target treats every error Status as a normal
// outcome; it stops the process only for a real bug (a sanitizer finding, an uncaught
// exception, or an ECX_FUZZ_CHECK that fails, e.g. a round trip that changes a value).
//
// The same sources build two ways (tests/fuzz/CMakeLists.txt):
//   ECX_FUZZ=ON (clang): linked with libFuzzer, which provides main().
//   otherwise:           linked with replay_main.cc, which runs every corpus file once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

// Aborts (so libFuzzer saves the input as a crash) when `cond` is false.
#define ECX_FUZZ_CHECK(cond, what)                                                              \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      std::fprintf(stderr, "%s:%d: fuzz invariant broken: %s (%s)\n", __FILE__, __LINE__, what, \
                   #cond);                                                                      \
      std::abort();                                                                             \
    }                                                                                           \
  } while (0)
