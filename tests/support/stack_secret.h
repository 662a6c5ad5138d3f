// The test stacks' deployment secret: a fresh one in this test process's environment
// (ECX_AUTH_TOKEN), which every service the test then starts inherits, as a user who
// sets ECX_AUTH_TOKEN for a deployment does. (`ecx demo` and the benchmarks hand theirs
// to their services as a file instead: serve::StackSecret.)
#pragma once

#include <cstdlib>
#include <string>

#include "ecx/common/auth.h"

namespace ecx::testing {

inline void use_new_stack_secret() {
  std::string secret;
  for (unsigned char c : random_bytes(32)) {
    static const char* kDigits = "0123456789abcdef";
    secret.push_back(kDigits[c >> 4]);
    secret.push_back(kDigits[c & 15]);
  }
  ::setenv("ECX_AUTH_TOKEN", secret.c_str(), /*overwrite=*/1);
}

}  // namespace ecx::testing
