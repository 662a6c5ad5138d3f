// Loading the reference model and the connector, as E and PD do at start-up.
#pragma once

#include <memory>

#include "ecx/connector/ec_connector.h"
#include "ecx/engine/model.h"
#include "ecx/serve/services.h"

namespace ecx::serve {

struct ModelBundle {
  engine::ModelConfig config;
  engine::Weights weights;
};
// The served model (common.model) with setup.weights, or seeded weights.
Result<ModelBundle> load_model(const CommonServiceConfig& common, const EngineConfig& setup);

// The connector config from --ec-config or --connector, with the model's compatibility
// hash, an engine id and the deployment secret filled in when absent.
// The deployment secret E's or PD's connector uses: the connector config's own
// (extra.auth_token / auth_token_file) first, as connector_config gives it, else
// ECX_AUTH_TOKEN / --auth-token-file; empty when there is none.
Result<std::string> deployment_secret(const EngineConfig& setup);

Result<connector::ConnectorConfig> connector_config(const EngineConfig& setup, connector::Role role,
                                                    const engine::ModelConfig& model,
                                                    const std::string& engine_id);

}  // namespace ecx::serve
