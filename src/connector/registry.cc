#include "connector/options.h"
#include "connector/p2p_connector.h"
#include "ecx/connector/ec_connector.h"

namespace ecx::connector {

Result<std::unique_ptr<EcConnector>> create_disk_connector(ConnectorConfig, ConnectorOptions,
                                                           ConnectorContext);
Result<std::unique_ptr<EcConnector>> create_store_connector(ConnectorConfig, ConnectorOptions,
                                                            ConnectorContext);
Result<std::unique_ptr<EcConnector>> create_local_connector(ConnectorConfig, ConnectorOptions,
                                                            ConnectorContext);

Result<std::unique_ptr<EcConnector>> create_connector(const ConnectorConfig& config,
                                                      ConnectorContext context) {
  ECX_ASSIGN_OR_RETURN(ConnectorOptions options,
                       ConnectorOptions::parse(config.connector, config.extra));
  if (config.connector == "p2p")
    return create_p2p_connector(config, std::move(options), std::move(context));
  if (config.connector == "disk")
    return create_disk_connector(config, std::move(options), std::move(context));
  if (config.connector == "store")
    return create_store_connector(config, std::move(options), std::move(context));
  if (config.connector == "local")
    return create_local_connector(config, std::move(options), std::move(context));
  return InvalidArgument("unknown connector '" + config.connector +
                         "' (expected p2p, disk, store or local)");
}

}  // namespace ecx::connector
