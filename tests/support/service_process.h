// A running `ecx serve ROLE` process for the multi-process service tests, and the chat
// request they send it.
#pragma once

#include <httplib.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ecx/common/status.h"
#include "ecx/common/subprocess.h"

namespace ecx::testing {

struct Service {
  std::optional<Subprocess> process;
  std::string url;
  std::string host;
  int port = 0;

  httplib::Client client(int timeout_s = 120) const;
  // SIGKILL, then waits (with a deadline) for the process to go.
  Status kill_now();
};

// Starts `ecx serve ROLE FLAGS...` and waits for it to listen.
Status start(Service& s, const std::string& role, std::vector<std::string> flags);

// A chat request with one 112x112 image of its own (seed) and `max_tokens` greedy tokens.
std::string image_request(uint64_t seed, int max_tokens = 4, bool stream = false);

httplib::Result chat(const Service& proxy, const std::string& body);

}  // namespace ecx::testing
