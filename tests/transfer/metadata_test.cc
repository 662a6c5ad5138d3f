#include "ecx/transfer/metadata.h"

#include <gtest/gtest.h>

namespace ecx::transfer {
namespace {

AgentMetadata sample() {
  AgentMetadata m;
  m.name = "e-0";
  m.protocol_version = 1;
  m.compat_hash = "qwen2.5-vl-3b/bf16";
  m.host_id = "boot/host";
  m.shm_endpoint = "ecx-e-0-1-0";
  m.tcp_endpoint = "127.0.0.1:5000";
  m.ucx_address = "0a0b0c";
  m.regions = {{1, 1 << 20, MemoryKind::kHost, false, true},
               {2, 4096, MemoryKind::kHost, true, false, "00112233445566778899"}};
  return m;
}

TEST(AgentMetadata, JsonRoundTrip) {
  AgentMetadata m = sample();
  auto back = AgentMetadata::parse(m.to_json());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, m);
}

TEST(AgentMetadata, RejectsMalformedInputWithoutThrowing) {
  const char* bad[] = {
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
      R"({"name":"a","protocol_version":1,"compat_hash":"x","endpoints":{},"regions":[{"id":1,"length":1,"kind":"host","remote_write":false,"shareable":false,"ucx_key":"0G"}]})",
  };
  for (const char* text : bad) {
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

}  // namespace
}  // namespace ecx::transfer
