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
#include <cstdlib>

namespace {

struct TestEnvironment {
  TestEnvironment() {
    ::setenv("UCX_HANDLE_ERRORS", "none", /*overwrite=*/0);
    ::setenv("UCX_NET_DEVICES", "lo", /*overwrite=*/0);
#ifdef ECX_TEST_TSAN
    ::setenv("UCX_MEM_MMAP_HOOK_MODE", "none", /*overwrite=*/0);
#endif
  }
};

const TestEnvironment kTestEnvironment;

}  // namespace
