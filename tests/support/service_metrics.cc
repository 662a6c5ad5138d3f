#include "support/service_metrics.h"

#include <httplib.h>

#include <sstream>
#include <thread>

#include "support/poll.h"

namespace ecx::testing {

double metric_in(const std::string& text, const std::string& name) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  }
  return -1;
}

double metric(const std::string& url, const std::string& name) {
  auto res = httplib::Client(url).Get("/metrics");
  if (!res || res->status != 200) return -1;
  return metric_in(res->body, name);
}

bool metric_reaches(const std::string& url, const std::string& name, double want, Deadline deadline,
                    double* last) {
  return poll_until(deadline, [&] {
    double value = metric(url, name);
    if (last != nullptr) *last = value;
    return value == want;
  });
}

}  // namespace ecx::testing
