"""What the halves of ECXConnector share: the ecx config of a vLLM instance, item names,
dtypes, and where a worker's agent is found by its scheduler (the rendezvous)."""
from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

import ecx

logger = logging.getLogger("vllm.ecx")  # under "vllm": printed with vLLM's own log lines

DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}

_ECX_KEY = re.compile(r"^[A-Za-z0-9_:-][A-Za-z0-9_.:-]{0,127}$")
# vLLM's name for an item when neither its processor cache nor prefix caching is on and
# no uuid was given (vllm/renderers/base.py): a per-process counter, not the content.
_COUNTER_NAME = re.compile(r"^renderer\d+-mm-\d+-[a-z_]+-\d+$")
_ROLES = {"ec_producer": "producer", "ec_consumer": "consumer", "ec_both": "both"}
# ec_connector_extra_config keys read here; every other key is an ecx connector option
# (docs/CONNECTORS.md), checked by ecx itself.
_OWN_OPTIONS = ("connector", "metrics_port", "metrics_host", "rendezvous_dir",
                "params_timeout_ms", "first_look_wait_ms", "first_look_step_ms", "log_level",
                "copy_cache")
# The C++ core's levels (spdlog's names; "warning" and "error" as Python spells them).
_LOG_LEVELS = {"trace": "trace", "debug": "debug", "info": "info", "warn": "warn",
               "warning": "warn", "error": "err", "err": "err", "critical": "critical",
               "off": "off"}
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost")  # as the agent has it (agent.cc)
# The fields of ecx's params in an ec_transfer_params entry (vLLM adds "metadata" and
# "item_indices" beside them).
PARAMS_FIELDS = frozenset({
    "connector", "mode", "engine_id", "agent", "compat_hash", "mm_hash", "dtype", "shape",
    "num_tokens", "region", "offset", "length", "generation", "pin", "capability", "signature"})


def ecx_key(identifier: str) -> str:
    """vLLM's mm_hash as an ecx key: itself when it fits ecx's alphabet, else its sha256."""
    if _ECX_KEY.match(identifier):
        return identifier
    return "sha256-" + hashlib.sha256(identifier.encode()).hexdigest()


def is_counter_name(identifier: str) -> bool:
    """Whether vLLM named this item by arrival order instead of by content."""
    return bool(_COUNTER_NAME.match(identifier))


def names_items_by_counter(vllm_config) -> bool:
    """Whether this instance names items it is given without a uuid by a counter."""
    mm = getattr(vllm_config.model_config, "multimodal_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    return bool(mm is not None and mm.mm_processor_cache_gb == 0 and cache is not None
                and not cache.enable_prefix_caching)


@dataclass
class InstanceConfig:
    """One vLLM instance's ECXConnector settings, the same in every one of its processes."""

    name: str  # base of the agent names: <name>-sched, <name>-w<rank>
    role: str  # "producer", "consumer", "both"
    extra: dict  # ecx connector options (without engine_id)
    policy: str  # "recompute" or "fail"
    load_timeout_ms: int
    params_timeout_ms: int  # the producer scheduler's ask to its worker
    first_look_wait_ms: int  # the consumer scheduler's wait for a load it just started
    first_look_step_ms: int  # ... and for all those of one step together
    metrics_port: int | None
    metrics_host: str  # the exporter's bind address
    rendezvous_dir: str | None
    tp_size: int
    dp_local_rank: int = 0  # data parallel: this engine's rank among those on its host
    log_level: str | None = None  # the C++ core's (log_level, ECX_LOG_LEVEL); None: its own
    copy_cache: int | str = "64MiB"  # a worker's idle buffers for host copies (CopyBuffers)

    @property
    def is_producer(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("consumer", "both")

    def process_offset(self, worker_rank: int | None) -> int:
        """This process's place among the instance's processes on its host: 0 its scheduler
        (EngineCore), 1 + rank each worker, one such run per data-parallel engine. A fixed
        port (tcp_port, metrics_port) is a base, and each process takes base + offset."""
        own = 0 if worker_rank is None else 1 + worker_rank
        return self.dp_local_rank * (1 + self.tp_size) + own

    def ecx_config(self, role: str, agent: str, offset: int, **overrides) -> str:
        """The JSON config of the ecx connector of this instance's process at `offset`."""
        extra = {**self.extra, **overrides, "engine_id": agent}
        if extra.get("tcp_port"):  # a base: every process listens on a port of its own
            extra["tcp_port"] = port_at("tcp_port", extra["tcp_port"], offset)
        return json.dumps({"connector": "p2p", "role": role, "extra": extra})


def port_at(key: str, base: int, offset: int) -> int:
    """The port of the process at `offset` for a base port; a ValueError past 65535."""
    if base + offset > 65535:
        raise ValueError(f"ECXConnector: '{key}' {base} + {offset} (this process's offset) is "
                         "past 65535: pick a lower base")
    return base + offset


def instance_config(vllm_config) -> InstanceConfig:
    """ECXConnector's settings from vLLM's config: a ValueError names what is wrong."""
    ec = vllm_config.ec_transfer_config
    extra = dict(ec.ec_connector_extra_config or {})
    kind = extra.pop("connector", "p2p")
    if kind != "p2p":
        raise ValueError(f"ECXConnector: ec_connector_extra_config 'connector' is {kind!r}; "
                         "inside vLLM it moves items with ecx's p2p connector only")
    role = _ROLES.get(ec.ec_role or "")
    if role is None:
        raise ValueError(f"ECXConnector: unknown ec_role {ec.ec_role!r}")
    metrics_port = extra.pop("metrics_port", None)
    if metrics_port is not None and (type(metrics_port) is not int
                                     or not 1 <= metrics_port <= 65535 - 64):
        raise ValueError("ECXConnector: ec_connector_extra_config 'metrics_port' must be an "
                         f"integer port (1-65471), not {metrics_port!r}")
    metrics_host = extra.pop("metrics_host", "127.0.0.1")
    if not isinstance(metrics_host, str) or not _is_ip_address(metrics_host):
        raise ValueError("ECXConnector: ec_connector_extra_config 'metrics_host' must be an "
                         f"IP address to bind (e.g. 127.0.0.1, 0.0.0.0), not {metrics_host!r}")
    rendezvous = extra.pop("rendezvous_dir", None)
    if rendezvous is not None and not isinstance(rendezvous, str):
        raise ValueError("ECXConnector: 'rendezvous_dir' must be a string")
    params_timeout = extra.pop("params_timeout_ms", 2000)
    if type(params_timeout) is not int or params_timeout <= 0:
        raise ValueError("ECXConnector: 'params_timeout_ms' must be a positive integer")
    first_look = extra.pop("first_look_wait_ms", 10)
    if type(first_look) is not int or not 0 <= first_look <= 1000:
        raise ValueError("ECXConnector: 'first_look_wait_ms' must be an integer of 0 to 1000")
    first_look_step = extra.pop("first_look_step_ms", 50)
    if type(first_look_step) is not int or not 0 <= first_look_step <= 5000:
        raise ValueError("ECXConnector: 'first_look_step_ms' must be an integer of 0 to 5000")
    load_timeout = extra.get("load_timeout_ms", 10000)
    policy = extra.get("failure_policy", "recompute")
    if type(load_timeout) is not int or policy not in ("recompute", "fail"):
        raise ValueError("ECXConnector: 'load_timeout_ms' must be an integer and "
                         "'failure_policy' 'recompute' or 'fail'")
    copy_cache = extra.pop("copy_cache", "64MiB")
    try:
        if type(copy_cache) not in (int, str):
            raise TypeError
        ecx.CopyBuffers(copy_cache)
    except (TypeError, ecx.Error) as e:
        raise ValueError("ECXConnector: 'copy_cache' must be a size such as '64MiB' or a "
                         f"number of bytes, not {copy_cache!r}") from e
    log_level = extra.pop("log_level", os.environ.get("ECX_LOG_LEVEL"))
    if log_level is not None and log_level not in _LOG_LEVELS:
        raise ValueError("ECXConnector: 'log_level' (or ECX_LOG_LEVEL) must be one of "
                         f"{', '.join(_LOG_LEVELS)}, not {log_level!r}")
    _take_secret_from_environment(extra)
    tcp_port = extra.get("tcp_port", 0)
    if type(tcp_port) is not int or not 0 <= tcp_port <= 65535:
        raise ValueError("ECXConnector: 'tcp_port' must be an integer port (0: any free one; "
                         f"else the base of this instance's ports), not {tcp_port!r}")
    name = extra.pop("engine_id", None) or f"vllm-{ec.engine_id}"
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise ValueError("ECXConnector: pipeline parallel is not supported (tensor parallel is)")
    dp_local_rank = 0
    if getattr(parallel, "data_parallel_size", 1) > 1:
        name = f"{name}-dp{parallel.data_parallel_rank}"
        dp_local_rank = int(getattr(parallel, "data_parallel_rank_local", None) or 0)
    return InstanceConfig(name=name, role=role, extra=extra, policy=policy,
                          load_timeout_ms=load_timeout, params_timeout_ms=params_timeout,
                          first_look_wait_ms=first_look, first_look_step_ms=first_look_step,
                          metrics_port=metrics_port, metrics_host=metrics_host,
                          rendezvous_dir=rendezvous,
                          tp_size=getattr(parallel, "tensor_parallel_size", 1),
                          dp_local_rank=dp_local_rank, log_level=_LOG_LEVELS.get(log_level),
                          copy_cache=copy_cache)


def _take_secret_from_environment(extra: dict) -> None:
    """The deployment secret: the config's auth_token or auth_token_file (what the
    instance's config names comes first), else ECX_AUTH_TOKEN, else ECX_AUTH_TOKEN_FILE. Agents that listen
    beyond loopback need one: without it they would listen on 127.0.0.1 only, so every
    load from another host would recompute; refused here instead, naming the fix."""
    if not extra.get("auth_token") and not extra.get("auth_token_file"):
        if os.environ.get("ECX_AUTH_TOKEN"):
            extra["auth_token"] = os.environ["ECX_AUTH_TOKEN"]
        elif os.environ.get("ECX_AUTH_TOKEN_FILE"):
            extra["auth_token_file"] = os.environ["ECX_AUTH_TOKEN_FILE"]
    host = extra.get("tcp_host", "127.0.0.1")
    if host not in _LOOPBACK_HOSTS and not extra.get("auth_token") and \
            not extra.get("auth_token_file"):
        raise ValueError(
            f"ECXConnector: tcp_host {host!r} reaches other hosts, which needs the deployment "
            "secret: set ec_connector_extra_config 'auth_token_file' (a file of mode 600, the "
            "same on every E and PD; docs/SECURITY.md, \"The deployment secret\") or "
            "ECX_AUTH_TOKEN_FILE / ECX_AUTH_TOKEN in the engine's environment")


def log_start(config: InstanceConfig, process: str, conn) -> None:
    """One line per process at start: its agent, the address peers dial (as the agent
    published it), and the memory its pools hold (committed at start), so that the
    instance's sum can be checked."""
    stats = conn.stats()
    pools = sum(stats[k]["capacity_bytes"] for k in ("consumer_cache", "producer_pool")
                if stats.get(k))
    metadata = json.loads(conn.agent_metadata())
    dialed = metadata.get("endpoints", {}).get("tcp", "no tcp")
    logger.info("ECXConnector: %s of %s: agent %s, peers dial tcp %s (bound on %s), pools "
                "%.1f MiB in this process (docs/VLLM.md, \"Memory\": the instance holds its "
                "scheduler's and each worker's)", process, config.name, metadata.get("name"), dialed,
                config.extra.get("tcp_host", "127.0.0.1"), pools / (1 << 20))


def _is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def worker_agent(config: InstanceConfig, rank: int) -> str:
    return f"{config.name}-w{rank}"


def scheduler_agent(config: InstanceConfig) -> str:
    return f"{config.name}-sched"


def tensor_parallel_rank() -> int:
    """This worker's tensor parallel rank (0 outside vLLM's distributed setup)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except (ImportError, AssertionError):
        return 0


@contextlib.contextmanager
def io_threads_unbound():
    """While ecx starts its threads in a vLLM worker: the calling thread may use every CPU
    this process may, so the threads ecx creates (agent listeners, connections, loaders)
    inherit that, not the single core vLLM's CPU backend binds the worker's compute to.
    Without it, ecx's I/O threads queue behind spinning compute threads of every instance
    bound to the same core (a handshake went unanswered for 10 s on two cores). The
    worker's own binding is restored on exit."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        yield
        return
    bound = getter(0)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
        bound = None
    try:
        yield
    finally:
        if bound is not None:
            os.sched_setaffinity(0, bound)


def default_rendezvous_dir() -> Path:
    """$XDG_RUNTIME_DIR/ecx-<uid> (a per-user folder the system makes), else
    ~/.cache/ecx/rendezvous-<host> (this user's home: nobody else can make it first, as
    they can a name in a shared /tmp), else <tmp>/ecx-<uid>."""
    uid = os.getuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / f"ecx-{uid}"
    home = os.environ.get("HOME")
    if home:
        try:
            st = os.stat(home)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022:
                # Per host: a home folder may be shared between hosts (NFS).
                return Path(home) / ".cache" / "ecx" / f"rendezvous-{socket.gethostname()}"
        except OSError:
            pass
    return Path(tempfile.gettempdir()) / f"ecx-{uid}"


def _check_parent(folder: Path) -> None:
    """Only this user (or root) can rename or replace `folder`: its parent belongs to one of
    them, and a parent others may write to is sticky (as /tmp is)."""
    st = folder.parent.stat()
    if st.st_uid not in (0, os.getuid()):
        raise ValueError(f"ECXConnector: rendezvous folder {folder} is in {folder.parent}, "
                         f"which belongs to uid {st.st_uid}: that user could replace it; set "
                         "ec_connector_extra_config 'rendezvous_dir' to a folder of yours")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ValueError(f"ECXConnector: rendezvous folder {folder} is in {folder.parent}, "
                         f"which others may write to (mode {oct(st.st_mode & 0o7777)}, not "
                         "sticky): another user could swap the folder; set "
                         "ec_connector_extra_config 'rendezvous_dir' to another folder")


class Rendezvous:
    """Where a worker leaves its agent's metadata for its scheduler: one file per agent,
    in a folder only this user can reach (mode 0700, checked, never followed if it is a
    link, in a parent nobody else can rename it in). The metadata is no secret (agents
    prove the deployment secret to each other); the folder keeps other users from putting
    a false one there."""

    def __init__(self, folder: str | None):
        base = Path(folder) if folder else default_rendezvous_dir()
        try:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"ECXConnector: cannot make rendezvous folder {base}: {e}") from e
        st = base.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(
                f"ECXConnector: rendezvous folder {base} must be a folder of uid {os.getuid()} "
                f"with mode 0700 (found uid {st.st_uid}, mode {oct(st.st_mode & 0o7777)}); "
                "another user may have made it first: set ec_connector_extra_config "
                "'rendezvous_dir' to another folder")
        _check_parent(base)
        self.folder = base

    def _path(self, name: str) -> Path:
        return self.folder / (hashlib.sha256(name.encode()).hexdigest()[:32] + ".agent.json")

    def publish_document(self, name: str, doc: dict) -> None:
        """Leaves `doc` under `name` (replacing what was there, atomically)."""
        path = self._path(name)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"name": name, "document": doc}, f)
        os.replace(tmp, path)

    def lookup_document(self, name: str):
        """The document left under `name`; ValueError if there is none."""
        try:
            fd = os.open(self._path(name), os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"no {name} in {self.folder}: {e}") from e
        if not isinstance(doc, dict) or doc.get("name") != name or "document" not in doc:
            raise ValueError(f"the rendezvous file of {name} in {self.folder} is not its own")
        return doc["document"]

    def publish(self, agent: str, metadata: str) -> None:
        self.publish_document(agent, {"metadata": metadata})

    def lookup(self, agent: str) -> str:
        """The metadata `agent` published; ValueError if there is none."""
        doc = self.lookup_document(agent)
        if not isinstance(doc, dict) or not isinstance(doc.get("metadata"), str):
            raise ValueError(f"the rendezvous file of {agent} in {self.folder} is not its own")
        return doc["metadata"]

    def withdraw(self, name: str) -> None:
        try:
            self._path(name).unlink()
        except OSError:
            pass
