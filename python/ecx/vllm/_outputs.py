"""What this model's encoder puts in vLLM's encoder cache, measured once at start.

An item in vLLM's encoder cache is whatever the model's `embed_multimodal` returned for
it: a 2-D tensor [tokens, width] whose width is the model's, not the language model's
hidden size (Qwen3-VL's DeepStack packs its levels beside the visual features:
out_hidden_size x (1 + levels); vLLM splits them after the cache), and whose tokens vary
by item (an image's patches, a video's frames). So ECXConnector never assumes a width: each
worker encodes one dummy item per modality right after vLLM loaded the model (vLLM's own
start-up measure for EC producers does the same, before the KV cache takes the memory) and
records each modality's dtype and width. A model whose output ECX cannot carry is refused
there, at start, naming the model. Worker 0 leaves the figures in the instance's
rendezvous folder (and takes them away at shutdown); the scheduler (another process, in
general) reads them on its first check and checks each item's params against them."""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

from ._common import DTYPES, Rendezvous, logger


@dataclass(frozen=True)
class EncoderOutput:
    """One modality's items: [tokens, width] tensors of `dtype` (an ecx dtype name)."""

    dtype: str
    width: int

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "width": self.width}

    @staticmethod
    def from_json(doc) -> "EncoderOutput":
        if not isinstance(doc, dict) or doc.get("dtype") not in DTYPES.values() or \
                type(doc.get("width")) is not int or doc["width"] <= 0:
            raise ValueError(f"not an encoder output description: {doc!r}")
        return EncoderOutput(doc["dtype"], doc["width"])


def _calling_worker(depth: int = 6):
    """The vLLM worker whose load_model called start_worker_services (a caller's `self`
    with a model runner), or None. vLLM hands an EC connector no handle to the model."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        runner = getattr(owner, "model_runner", None)
        if runner is not None and callable(getattr(runner, "get_model", None)) and \
                getattr(owner, "vllm_config", None) is not None:
            return owner
        frame = frame.f_back
    return None


def describe(model: str, modality: str, outputs) -> EncoderOutput:
    """The EncoderOutput of one modality's dummy outputs (what embed_multimodal returned
    for a batch: a list of per-item tensors, or one tensor whose first dimension is the
    item); ValueError, naming the model, for an output ECX cannot carry."""
    first = outputs[0] if isinstance(outputs, (list, tuple, torch.Tensor)) and len(outputs) \
        else outputs
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"ECXConnector cannot carry {model}'s {modality} encoder output: "
                         f"a {type(first).__name__}, not a tensor")
    if first.dim() != 2:
        raise ValueError(f"ECXConnector cannot carry {model}'s {modality} encoder output of "
                         f"shape {list(first.shape)}: vLLM's encoder cache holds 2-D items")
    dtype = DTYPES.get(first.dtype)
    if dtype is None:
        raise ValueError(f"ECXConnector cannot carry {model}'s {modality} encoder output of "
                         f"dtype {first.dtype} (it carries {', '.join(map(str, DTYPES))})")
    return EncoderOutput(dtype, int(first.shape[-1]))


@torch.inference_mode()
def measure(worker) -> dict[str, EncoderOutput]:
    """Encodes one dummy item of each modality the model takes, as vLLM's start-up profile
    does; {} for a model that takes none. Every tensor-parallel rank runs it (the encoder's
    layers may talk across ranks)."""
    from vllm.config import set_current_vllm_config
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget
    from vllm.multimodal.utils import group_and_batch_mm_kwargs

    runner = worker.model_runner
    config = worker.vllm_config
    if not getattr(runner, "supports_mm_inputs", False):
        return {}
    model_name = config.model_config.model
    found: dict[str, EncoderOutput] = {}
    # As vLLM runs its own dummy encodes: under the instance's config (layers may ask for
    # it), in small allocator pieces where the worker has that scope (a GPU's).
    split = getattr(worker, "_scoped_allocator_max_split", None)
    with set_current_vllm_config(config), \
            (split(max_split_size_mb=20) if callable(split) else contextlib.nullcontext()):
        budget = MultiModalBudget(config, MULTIMODAL_REGISTRY, enable_cache=False)
        model = runner.get_model()
        # In one order on every rank: the ranks' collectives inside the encoder must meet
        # (vLLM may build this mapping from a set, whose order differs between processes).
        for modality in sorted(budget.mm_max_toks_per_item):
            items = budget.get_dummy_encoder_profile_inputs(modality, 1)
            if not items:
                continue
            _, _, kwargs = next(group_and_batch_mm_kwargs(items, device=runner.device,
                                                          pin_memory=False))
            outputs = model.embed_multimodal(**kwargs)
            found[modality] = describe(model_name, modality, outputs)
            del outputs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the dummy items' memory goes back before vLLM sizes the KV cache
    return found


def measure_and_publish(instance: str, rank: int, rendezvous: Rendezvous) -> bool:
    """At a worker's start, after vLLM loaded the model: measures, refuses what ECX cannot
    carry (ValueError: vLLM does not start), and (rank 0) publishes for the scheduler;
    whether it published."""
    worker = _calling_worker()
    if worker is None:
        raise ValueError("ECXConnector: start_worker_services was not called by a vLLM "
                         "worker's load_model, so the encoder's outputs cannot be measured "
                         "(a vLLM version ECXConnector does not support)")
    found = measure(worker)
    logger.info("ECXConnector: %s's encoder outputs: %s", worker.vllm_config.model_config.model,
                {m: f"{o.dtype}[tokens, {o.width}]" for m, o in found.items()} or "none")
    if rank != 0:
        return False
    rendezvous.publish_document(
        _document_name(instance), {"instance_id": worker.vllm_config.instance_id,
                                   "outputs": {m: o.to_json() for m, o in found.items()}})
    return True


def withdraw_outputs(instance: str, instance_id: str, rendezvous: Rendezvous) -> None:
    """Takes this start's measure away (a later start of the same instance name, already
    up, keeps its own); never raises."""
    try:
        name = _document_name(instance)
        doc = rendezvous.lookup_document(name)
        if isinstance(doc, dict) and doc.get("instance_id") == instance_id:
            rendezvous.withdraw(name)
    except (OSError, ValueError):
        pass


def lookup(instance: str, instance_id: str, rendezvous: Rendezvous) -> dict[str, EncoderOutput]:
    """What worker 0 of this very start (vLLM's instance_id) measured; ValueError if it
    left nothing (vLLM loads the model in every worker before it makes the scheduler)."""
    name = _document_name(instance)
    doc = rendezvous.lookup_document(name)
    if not isinstance(doc, dict) or doc.get("instance_id") != instance_id or \
            not isinstance(doc.get("outputs"), dict):
        raise ValueError(f"ECXConnector: the encoder outputs in {rendezvous.folder} are not "
                         f"those of this start of {instance} (vLLM instance {instance_id})")
    return {m: EncoderOutput.from_json(o) for m, o in doc["outputs"].items()}


def _document_name(instance: str) -> str:
    return f"{instance}/encoder-outputs"
