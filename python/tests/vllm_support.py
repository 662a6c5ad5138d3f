"""Building vLLM objects for the ECXConnector tests without a GPU: a VllmConfig stand-in
holding a real ECTransferConfig (as vLLM's own EC connector unit tests do), real Request
and MultiModalFeatureSpec objects, and seeded bf16 tensors."""
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no GPU driver here: vLLM's CPU platform

from unittest.mock import Mock  # noqa: E402

import torch  # noqa: E402
from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402


def vllm_config(ec_role: str, extra: dict):
    config = Mock(spec=VllmConfig)
    config.ec_transfer_config = ECTransferConfig(
        ec_connector="ECXConnector", ec_connector_module_path="ecx.vllm", ec_role=ec_role,
        ec_connector_extra_config=extra)
    config.parallel_config = Mock(world_size=1)
    return config


def connectors(ec_role: str, extra: dict):
    """The scheduler-side and worker-side connectors, made by vLLM's own factory."""
    config = vllm_config(ec_role, extra)
    return (ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER),
            ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER))


def request(request_id: str, items: list[tuple[str, int]], ec_transfer_params=None) -> Request:
    """A request with one image per (mm_hash, number of embeddings)."""
    features, offset = [], 1
    for mm_hash, tokens in items:
        features.append(MultiModalFeatureSpec(data=None, modality="image", identifier=mm_hash,
                                              mm_position=PlaceholderRange(offset=offset,
                                                                           length=tokens)))
        offset += tokens
    extra_args = {"ec_transfer_params": ec_transfer_params} if ec_transfer_params else None
    params = SamplingParams(max_tokens=1, extra_args=extra_args)
    return Request(request_id, [0] * (offset + 1), params, None, mm_features=features)


def tensor(seed: int, shape: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)


def empty_step() -> SchedulerOutput:
    return SchedulerOutput.make_empty()
