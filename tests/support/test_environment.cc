// The environment every test process (and the peer processes it starts) runs in, set
// before main() and before UCX is loaded. A variable the person running the tests set
// is kept.
//   UCX_HANDLE_ERRORS=none: UCX installs no crash handlers (the sanitizers report).
//   UCX_NET_DEVICES=lo: every agent of a test runs on loopback. Without it UCX's tcp
//     transport also offers the addresses of other interfaces, such as the veth pairs the
//     multihost tests create and remove meanwhile (ctest -j2), and a peer that dials one
//     of those after it went is refused.
//   UCX_MEM_MMAP_HOOK_MODE=none under ThreadSanitizer: UCX's mmap hooks crash TSan at
//     thread exit; the tests register no RDMA memory, which is what the hooks are for.
// spdlog's logger registry is made here, before any thread, as a program's start-up
// (set_log_level) makes it: made by the first log line of two threads at once, it is a
// function-local static in Debian's uninstrumented libspdlog, whose guard ThreadSanitizer
// cannot see (a test whose first lines were two agents' warnings reported a race there).
#include <spdlog/spdlog.h>

#include <cstdlib>

namespace {

struct TestEnvironment {
  TestEnvironment() {
    ::setenv("UCX_HANDLE_ERRORS", "none", /*overwrite=*/0);
    ::setenv("UCX_NET_DEVICES", "lo", /*overwrite=*/0);
#ifdef ECX_TEST_TSAN
    ::setenv("UCX_MEM_MMAP_HOOK_MODE", "none", /*overwrite=*/0);
#endif
    spdlog::default_logger_raw();
  }
};

const TestEnvironment kTestEnvironment;

}  // namespace
