#include "serve/model_setup.h"

#include "ecx/common/auth.h"

namespace ecx::serve {

Result<ModelBundle> load_model(const CommonServiceConfig& common, const EngineConfig& setup) {
  ModelBundle b;
  b.config.model_id = common.model;
  if (setup.weights.empty()) {
    b.weights = engine::Weights::seeded(b.config);
  } else {
    ECX_ASSIGN_OR_RETURN(b.weights, engine::Weights::load(setup.weights, b.config));
  }
  return b;
}

Result<connector::ConnectorConfig> connector_config(const EngineConfig& setup, connector::Role role,
                                                    const engine::ModelConfig& model,
                                                    const std::string& engine_id) {
  connector::ConnectorConfig cc;
  if (!setup.ec_config.empty()) {
    ECX_ASSIGN_OR_RETURN(cc, connector::ConnectorConfig::parse(setup.ec_config));
    cc.role = role;
  } else {
    ECX_ASSIGN_OR_RETURN(cc, connector::ConnectorConfig::from_name(setup.connector, role));
  }
  if (!cc.extra.contains("compat_hash")) cc.extra["compat_hash"] = model.compat_hash();
  if (!cc.extra.contains("engine_id")) cc.extra["engine_id"] = engine_id;
  if (!cc.extra.contains("auth_token") && !cc.extra.contains("auth_token_file")) {
    if (!setup.auth_token.empty()) {
      cc.extra["auth_token"] = setup.auth_token;
    } else if (!setup.auth_token_file.empty()) {
      cc.extra["auth_token_file"] = setup.auth_token_file;
    }
  }
  return cc;
}

Result<std::string> deployment_secret(const EngineConfig& setup) {
  if (!setup.ec_config.empty()) {
    ECX_ASSIGN_OR_RETURN(auto cc, connector::ConnectorConfig::parse(setup.ec_config));
    auto token = cc.extra.find("auth_token");
    auto file = cc.extra.find("auth_token_file");
    if (token != cc.extra.end() || file != cc.extra.end()) {
      return load_secret(
          token != cc.extra.end() && token->is_string() ? token->get<std::string>() : std::string(),
          file != cc.extra.end() && file->is_string() ? file->get<std::string>() : std::string());
    }
  }
  return load_secret(setup.auth_token, setup.auth_token_file);
}

}  // namespace ecx::serve
