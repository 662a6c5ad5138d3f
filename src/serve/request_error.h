// Answering a request with the error its parsing (openai/openai_request.h) or one of a
// service's steps found.
#pragma once

#include "http_server/http_server.h"
#include "openai/openai_request.h"

namespace ecx::serve {

// {"error":{"message","type","code"}} with the error's status.
inline void send_error(HttpResponse& res, const RequestError& error) {
  send_error(res, error.http_status, error.type, error.message);
}

}  // namespace ecx::serve
