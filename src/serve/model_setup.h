// Loading the reference model and the connector, as every service does at start-up.
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
Result<ModelBundle> load_model(const ServiceConfig& config);

// The connector config from --ec-config or --connector, with the model's compatibility
// hash and an engine id filled in when absent.
Result<connector::ConnectorConfig> connector_config(const ServiceConfig& config,
                                                    connector::Role role,
                                                    const engine::ModelConfig& model,
                                                    const std::string& engine_id);

}  // namespace ecx::serve
