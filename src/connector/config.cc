#include <unistd.h>

#include <cstring>

#include "ecx/common/auth.h"
#include "ecx/common/enum_names.h"
#include "ecx/common/json_reader.h"
#include "ecx/connector/ec_connector.h"

namespace ecx::connector {

using nlohmann::json;

namespace {

constexpr EnumName<Role> kRoles[] = {
    {Role::kProducer, "producer"}, {Role::kConsumer, "consumer"}, {Role::kBoth, "both"}};

}  // namespace

Result<Role> parse_role(std::string_view name) { return parse_name<Role>(kRoles, name, "role"); }

std::string_view role_name(Role role) { return name_of<Role>(kRoles, role); }

Result<ConnectorConfig> ConnectorConfig::parse(std::string_view text) {
  ECX_ASSIGN_OR_RETURN(json j, parse_json_object(text, "connector config"));
  JsonReader r(j, "connector config");
  ConnectorConfig c;
  ECX_ASSIGN_OR_RETURN(c.connector, r.string("connector", Presence::kRequired, 64));
  ECX_ASSIGN_OR_RETURN(std::string role, r.string("role", Presence::kOptional, 64, "both"));
  ECX_ASSIGN_OR_RETURN(c.role, parse_role(role));
  ECX_ASSIGN_OR_RETURN(const json* extra, r.object("extra"));
  if (extra != nullptr) c.extra = *extra;
  return c;
}

Result<ConnectorConfig> ConnectorConfig::from_name(std::string_view name, Role role) {
  ConnectorConfig c;
  c.role = role;
  auto colon = name.find(':');
  c.connector = std::string(name.substr(0, colon));
  if (colon != std::string_view::npos) {
    if (c.connector != "p2p") {
      return InvalidArgument("connector '" + std::string(name) + "': only p2p has modes");
    }
    c.extra["mode"] = std::string(name.substr(colon + 1));
  }
  return c;
}

json ConnectorConfig::to_json() const {
  return {{"connector", connector}, {"role", std::string(role_name(role))}, {"extra", extra}};
}

}  // namespace ecx::connector
