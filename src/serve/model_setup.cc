#include "serve/model_setup.h"

namespace ecx::serve {

Result<ModelBundle> load_model(const ServiceConfig& config) {
  ModelBundle b;
  b.config.model_id = config.model;
  if (config.weights.empty()) {
    b.weights = engine::Weights::seeded(b.config);
  } else {
    ECX_ASSIGN_OR_RETURN(b.weights, engine::Weights::load(config.weights, b.config));
  }
  return b;
}

Result<connector::ConnectorConfig> connector_config(const ServiceConfig& config,
                                                    connector::Role role,
                                                    const engine::ModelConfig& model,
                                                    const std::string& engine_id) {
  connector::ConnectorConfig cc;
  if (!config.ec_config.empty()) {
    ECX_ASSIGN_OR_RETURN(cc, connector::ConnectorConfig::parse(config.ec_config));
    cc.role = role;
  } else {
    ECX_ASSIGN_OR_RETURN(cc, connector::ConnectorConfig::from_name(config.connector, role));
  }
  if (!cc.extra.contains("compat_hash")) cc.extra["compat_hash"] = model.compat_hash();
  if (!cc.extra.contains("engine_id")) cc.extra["engine_id"] = engine_id;
  if (!cc.extra.contains("auth_token") && !cc.extra.contains("auth_token_file")) {
    if (!config.auth_token.empty()) {
      cc.extra["auth_token"] = config.auth_token;
    } else if (!config.auth_token_file.empty()) {
      cc.extra["auth_token_file"] = config.auth_token_file;
    }
  }
  return cc;
}

}  // namespace ecx::serve
