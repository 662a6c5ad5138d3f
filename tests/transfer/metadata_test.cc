#include "ecx/transfer/metadata.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

namespace ecx::transfer {
namespace {

AgentMetadata sample() {
  AgentMetadata m;
  m.name = "e-0";
  m.protocol_version = 1;
  m.compat_hash = "qwen2.5-vl-3b/bf16";
  m.host_id = "boot/host";
  m.endpoints = {
      {Backend::kShm, "ecx-e-0-1-0"}, {Backend::kTcp, "127.0.0.1:5000"}, {Backend::kUcx, "0a0b0c"}};
  m.regions = {
      {1, 1 << 20, MemoryKind::kHost, false, true},
      {2, 4096, MemoryKind::kHost, true, false, {{Backend::kUcx, "00112233445566778899"}}}};
  return m;
}

TEST(AgentMetadata, JsonRoundTrip) {
  AgentMetadata m = sample();
  auto back = AgentMetadata::parse(m.to_json());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, m);
}

TEST(AgentMetadata, RejectsMalformedInputWithoutThrowing) {
  const std::string bad[] = {
      "",
      "not json",
      "[]",
      "{}",
      R"({"name":"","protocol_version":1,"compat_hash":"x","endpoints":{},"regions":[]})",
      R"({"name":"a","protocol_version":-1,"compat_hash":"x","endpoints":{},"regions":[]})",
      R"({"name":"a","protocol_version":1,"compat_hash":7,"endpoints":{},"regions":[]})",
      R"({"name":"a","protocol_version":1,"compat_hash":"x","endpoints":{},"regions":{}})",
      R"({"name":"a","protocol_version":1,"compat_hash":"x","endpoints":{},"regions":[{"id":1}]})",
      R"({"name":"a","protocol_version":1,"compat_hash":"x","endpoints":{},"regions":[{"id":1,"length":1e300,"kind":"host"}]})",
      R"({"name":"a","protocol_version":1,"compat_hash":"x","endpoints":{},"regions":[{"id":1,"length":1099511627776000,"kind":"host"}]})",
      R"({"name":"a","protocol_version":1,"compat_hash":"x","endpoints":{},"regions":[{"id":5000000000,"length":1,"kind":"host"}]})",
      R"({"name":"a","protocol_version":1,"compat_hash":"x","endpoints":{},"regions":[{"id":1,"length":1,"kind":"tpu"}]})",
      // ucx worker addresses and keys are whole bytes of lower-case hex.
      R"({"name":"a","protocol_version":1,"compat_hash":"x","endpoints":{"ucx":"zz"},"regions":[]})",
      R"({"name":"a","protocol_version":1,"compat_hash":"x","endpoints":{"ucx":"abc"},"regions":[]})",
      R"({"name":"a","protocol_version":1,"compat_hash":"x","endpoints":{},"regions":[{"id":1,"length":1,"kind":"host","remote_write":false,"shareable":false,"backend_data":{"ucx":"0G"}}]})",
      // an shm endpoint longer than an abstract socket address holds
      R"({"name":"a","protocol_version":1,"compat_hash":"x","endpoints":{"shm":")" +
          std::string(200, 'e') + R"("},"regions":[]})",
  };
  for (const std::string& text : bad) {
    auto r = AgentMetadata::parse(text);
    EXPECT_FALSE(r.ok()) << text;
  }
  std::string long_name =
      R"({"name":")" + std::string(1000, 'a') +
      R"(","protocol_version":1,"compat_hash":"x","endpoints":{},"regions":[]})";
  EXPECT_FALSE(AgentMetadata::parse(long_name).ok());
}

TEST(AgentMetadata, BackendNames) {
  EXPECT_EQ(*parse_backend("shm"), Backend::kShm);
  EXPECT_EQ(*parse_backend("tcp"), Backend::kTcp);
  EXPECT_EQ(*parse_backend("auto"), Backend::kAuto);
  EXPECT_EQ(*parse_backend("ucx"), Backend::kUcx);
  auto bad = parse_backend("rdma");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("rdma"), std::string::npos);
}

// Two network namespaces (the test hosts of scripts/hosts) are two hosts: neither can
// reach the other's abstract unix sockets, so `auto` must not pick shm between them.
TEST(AgentMetadata, HostIdDiffersInAnotherNetworkNamespace) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    if (::unshare(CLONE_NEWNET) != 0) ::_exit(3);
    std::string id = local_host_id();
    ::_exit(::write(fds[1], id.data(), id.size()) == static_cast<ssize_t>(id.size()) ? 0 : 1);
  }
  ::close(fds[1]);
  std::string theirs;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof(buf))) > 0;) theirs.append(buf, n);
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 3) GTEST_SKIP() << "unshare(CLONE_NEWNET) needs CAP_SYS_ADMIN";
  ASSERT_EQ(WEXITSTATUS(status), 0);
  std::string ours = local_host_id();
  EXPECT_NE(theirs, ours);
  // Same machine otherwise: the boot id and hostname part agree.
  EXPECT_EQ(theirs.substr(0, theirs.rfind('/')), ours.substr(0, ours.rfind('/')));
}

}  // namespace
}  // namespace ecx::transfer
