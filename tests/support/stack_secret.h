// The test stacks' deployment secret: a fresh one in this test process's environment
// (ECX_AUTH_TOKEN), which every service the test then starts inherits, as a user who
// sets ECX_AUTH_TOKEN for a deployment does. (`ecx demo` and the benchmarks hand theirs
// to their services as a file instead: serve::StackSecret.)
#pragma once

#include <cstdlib>
#include <string>

#include "ecx/common/auth.h"
#include "ecx/common/bytes.h"

namespace ecx::testing {

inline void use_new_stack_secret() {
  const std::string bytes = random_bytes(32);
  ::setenv("ECX_AUTH_TOKEN", hex_encode(bytes.data(), bytes.size()).c_str(), /*overwrite=*/1);
}

}  // namespace ecx::testing
