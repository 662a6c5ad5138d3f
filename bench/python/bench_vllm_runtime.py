"""The machinery of bench_vllm.py: vLLM server processes, the engine lock, `vllm bench
serve`, the correctness requests, and the table and chart. Imports neither vLLM nor ecx."""
from __future__ import annotations

import atexit
import base64
import ctypes
import fcntl
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

VENV_BIN = Path(sys.prefix) / "bin"
LOCK_PATH = "/tmp/ecx-vllm-engines.lock"  # shared with every other engine run on this host
TIMING_MODULE = "ecx_vllm_timing"  # bench_vllm_timing.py, as the engines import it
MODEL_NAME = "tiny-vlm"
STOP_GRACE_S = 10.0
READY_MARK = b"Application startup complete"
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_timing_path: str | None = None
_live: set["Proc"] = set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """A port p such that p..p+n-1 were free a moment ago, below the ephemeral range (a
    base port for an instance's processes: ECXConnector's tcp_port)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 30000 - n)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def install_timing_module(run_dir: Path, source: Path) -> None:
    """Puts bench_vllm_timing.py on the engines' PYTHONPATH as `ecx_vllm_timing`."""
    global _timing_path
    d = run_dir / "pythonpath"
    d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, d / f"{TIMING_MODULE}.py")
    _timing_path = str(d)


def vllm_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1",
                "PYTHONUNBUFFERED": "1"})
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per instance; several share 24 GiB
    if _timing_path:
        env["PYTHONPATH"] = os.pathsep.join(
            [_timing_path] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def serve_argv(model: Path, port: int, *extra: str, host: str = "127.0.0.1") -> list[str]:
    return [str(VENV_BIN / "vllm"), "serve", str(model), "--host", host,
            "--port", str(port), "--served-model-name", MODEL_NAME, "--enforce-eager", *extra]


# ---------------------------------------------------------------- processes

def _own_group(parent: int) -> None:
    os.setsid()  # its own process group: stop() signals all of it
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the bench dies: so does the server
    if os.getppid() != parent:
        os._exit(1)


class StartError(RuntimeError):
    def __init__(self, proc: "Proc", why: str):
        super().__init__(f"{proc.name} {why}")
        self.proc = proc


class Proc:
    """A server (vllm serve, the proxy): its own process group, its output in a log file.
    Start it from the main thread (PR_SET_PDEATHSIG fires when the starting thread ends)."""

    def __init__(self, name: str, argv: list[str], env: dict, port: int, log_path: Path,
                 host: str = "127.0.0.1", netns: str | None = None):
        self.name, self.argv, self.env, self.port, self.log_path = name, argv, env, port, log_path
        self.host = host  # the address it serves on
        self.netns = netns  # the test host (scripts/hosts) it runs on; None: this one
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.done = threading.Event()
        self.ready_offset = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Proc":
        parent = os.getpid()
        argv = ["ip", "netns", "exec", self.netns, *self.argv] if self.netns else self.argv
        self.proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: _own_group(parent))
        _live.add(self)
        threading.Thread(target=self._pump, daemon=True, name=f"{self.name}-log").start()
        return self

    def _pump(self) -> None:
        with self.proc.stdout, open(self.log_path, "wb") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if not self.ready.is_set() and READY_MARK in line:
                    self.ready_offset = log.tell()
                    self.ready.set()
        self.done.set()

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def log_text(self, since_ready: bool = False) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[self.ready_offset if since_ready else 0:].decode(errors="replace")

    def encoder_iterations(self) -> int:
        """Iterations that ran the vision encoder since the server was up."""
        return sum(1 for m in re.finditer(r"encoder inputs: (\d+)", self.log_text(True))
                   if int(m.group(1)) > 0)

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL to what is left after STOP_GRACE_S."""
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
            try:  # the leader is gone: its children too
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        self.done.wait(10)
        _live.discard(self)


def wait_all(procs: list[Proc], timeout: float) -> None:
    """Until every server answers; StartError naming the first that exited or timed out."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.exited() and not p.ready.is_set():
                p.done.wait(10)
                raise StartError(p, f"exited with {p.proc.returncode} while starting")
        if all(p.ready.is_set() for p in procs):
            return
        if time.monotonic() > deadline:
            late = [p for p in procs if not p.ready.is_set()][0]
            raise StartError(late, f"not up within {timeout:.0f} s")
        time.sleep(0.5)


def _stop_all(*_):
    for p in list(_live):
        p.stop()


def install_signal_handlers() -> None:
    atexit.register(_stop_all)

    def handler(signum, _frame):
        _stop_all()
        sys.exit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)


class EngineLock:
    """Exclusive flock on LOCK_PATH for one configuration's engines."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def __enter__(self):
        self.file = open(LOCK_PATH, "a")
        deadline = time.monotonic() + self.timeout_s
        said = False
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if not said:
                    print(f"[bench vllm] waiting for {LOCK_PATH} (another engine run holds it)",
                          flush=True)
                    said = True
                if time.monotonic() > deadline:
                    self.file.close()
                    raise TimeoutError(f"{LOCK_PATH} still held after {self.timeout_s:.0f} s")
                time.sleep(1)

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


# ---------------------------------------------------------------- errors

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PREFIX = re.compile(r"^\((?:[\w.-]+ )?pid=\d+\)\s*(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                     r"[\d-]+ [\d:]+ \[[^\]]*\]\s*)?")
_EXC = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.+)$")
# Wrappers that only point at the root cause printed before them.
_GENERIC = ("Engine core initialization failed", "Worker failed", "Engine process failed",
            "WorkerProc initialization failed", "See root cause above")


def root_error(log_text: str) -> str | None:
    """The first exception of the log that is not a wrapper of an earlier one, with the
    indented line after it when there is one (pydantic puts the message there)."""
    lines = [_PREFIX.sub("", _ANSI.sub("", raw)).rstrip() for raw in log_text.splitlines()]
    found = []
    for i, line in enumerate(lines):
        if _EXC.match(line.strip()):
            text = line.strip()
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if nxt.startswith("  ") and not nxt.strip().startswith("File "):
                text += " " + nxt.strip().split(" [type=")[0]
            found.append(text)
    for text in found:
        if not any(g in text for g in _GENERIC):
            return text[:600]
    return found[-1][:600] if found else None


def first_log_error(text: str) -> str | None:
    """The first ERROR record or exception line of a log, without vLLM's prefix."""
    for raw in text.splitlines():
        line = _ANSI.sub("", raw).strip()
        if " ERROR " in line or _EXC.match(_PREFIX.sub("", line)):
            return re.sub(r"^\((?:[\w.-]+ )?pid=\d+\)\s*ERROR [\d-]+ [\d:]+ ", "", line)[:400]
    return None


def describe(exc: Exception, procs: list[Proc]) -> str:
    if isinstance(exc, StartError):
        cause = root_error(exc.proc.log_text())
        if cause is None:
            tail = [ln for ln in exc.proc.log_text().splitlines() if ln.strip()][-3:]
            cause = " | ".join(_ANSI.sub("", ln).strip() for ln in tail) or "no output"
        return f"{exc}: {cause}"
    return f"{type(exc).__name__}: {exc}"[:800]


# ---------------------------------------------------------------- the workload

def bench_serve(url: str, model: Path, w: dict, d: Path, timeout: float) -> dict:
    """`vllm bench serve` against `url`; its --save-result JSON (with --save-detailed)."""
    side = w["image_side"]
    argv = [str(VENV_BIN / "vllm"), "bench", "serve", "--backend", "openai-chat",
            "--base-url", url, "--endpoint", "/v1/chat/completions", "--model", MODEL_NAME,
            "--tokenizer", str(model), "--dataset-name", "random-mm",
            "--num-prompts", str(w["num_prompts"]), "--random-input-len", str(w["input_len"]),
            "--random-output-len", str(w["output_len"]), "--random-range-ratio", "0",
            "--random-mm-base-items-per-request", str(w["images_base"]),
            "--random-mm-num-mm-items-range-ratio", str(w["images_range_ratio"]),
            "--random-mm-limit-mm-per-prompt", json.dumps(mm_limits(w)),
            "--random-mm-bucket-config", f"{{({side}, {side}, {w['frames']}): 1.0}}",
            "--request-rate", "inf", "--temperature", "0", "--seed", str(w["seed"]),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(d),
            "--result-filename", "bench_serve.json", "--disable-tqdm"]
    if w.get("max_concurrency"):
        argv += ["--max-concurrency", str(w["max_concurrency"])]
    # A Proc too: its own process group, stopped with the servers if the bench is.
    client = Proc("vllm bench serve", argv, vllm_env(), 0, d / "bench_serve.log").start()
    try:
        code = client.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        client.stop()
        raise RuntimeError(f"vllm bench serve: not done within {timeout:.0f} s") from None
    client.done.wait(10)
    _live.discard(client)
    text = client.log_text()
    if code != 0:
        raise RuntimeError(f"vllm bench serve exited with {code}: "
                           f"{root_error(text) or text[-400:]}")
    i = text.find("Serving Benchmark Result")
    block = text[text.rfind("\n", 0, i) + 1:] if i >= 0 else ""
    print(block.strip(), flush=True)
    return json.loads((d / "bench_serve.json").read_text())


def bench_figures(b: dict) -> dict:
    out = {"completed": b.get("completed"), "failed": b.get("failed"),
           "bench_texts": b.get("generated_texts")}
    errors = [str(e).strip() for e in (b.get("errors") or []) if e and str(e).strip()]
    if errors:  # a traceback's last line says what it was
        out["bench_error"] = errors[0].splitlines()[-1][:400]
    if not b.get("completed"):
        raise RuntimeError(f"every request of vllm bench serve failed: {out.get('bench_error')}")
    for metric in ("ttft", "tpot"):
        out[f"{metric}_ms"] = {"mean": b.get(f"mean_{metric}_ms"),
                               "median": b.get(f"median_{metric}_ms"),
                               "p99": b.get(f"p99_{metric}_ms")}
    out["req_per_s"] = b.get("request_throughput")
    out["output_tokens"] = b.get("total_output_tokens")
    out["output_tok_per_s"] = b.get("output_throughput")
    return out


def _png(seed: int, side: int) -> str:
    import numpy as np
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


PROMPTS = ["What is in the picture?", "Describe the images.", "Compare them.",
           "Which one is brightest?", "Count the objects.", "What color dominates?"]


def _mp4(seed: int, side: int, frames: int) -> str:
    """A noise video as random-mm makes them (MPEG-4 part 2 at 30 fps, OpenCV)."""
    import cv2
    import numpy as np
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "video.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 30, (side, side))
        for _ in range(frames):
            writer.write(rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8))
        writer.release()
        with open(path, "rb") as f:
            return "data:video/mp4;base64," + base64.b64encode(f.read()).decode()


def is_video(w: dict) -> bool:
    return w.get("frames", 1) > 1


def mm_limits(w: dict) -> dict:
    """Items per prompt the servers take, and random-mm sends: images, or videos."""
    return {"image": 0, "video": w["max_images"]} if is_video(w) else \
        {"image": w["max_images"], "video": 0}


def fixed_requests(w: dict) -> list[dict]:
    """The correctness requests: 1..max_images distinct noise images (or videos) each,
    greedy."""
    bodies, k = [], 0
    for i in range(w["correctness_prompts"]):
        n = 1 + i % w["max_images"]
        if is_video(w):
            content = [{"type": "video_url", "video_url": {
                "url": _mp4(1000 + k + j, w["image_side"], w["frames"])}} for j in range(n)]
        else:
            content = [{"type": "image_url", "image_url": {"url": _png(1000 + k + j,
                                                                       w["image_side"])}}
                       for j in range(n)]
        k += n
        content.append({"type": "text", "text": PROMPTS[i % len(PROMPTS)]})
        bodies.append({"model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
                       "max_tokens": w["output_len"], "temperature": 0, "ignore_eos": True,
                       "stream": False})
    return bodies


def chat(url: str, body: dict, timeout: float) -> str | None:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
        print(f"[bench vllm] correctness request failed: {e}", flush=True)
        return None


# ---------------------------------------------------------------- results

def empty_row(connector: str, row: str) -> dict:
    return {"connector": connector, "row": row,
            "layout": "single instance" if row == "single" else "E + PD, vLLM's EPD proxy",
            "ttft_ms": None, "tpot_ms": None, "req_per_s": None, "completed": None,
            "failed": None, "ec_load_ms_per_item": None, "ec_load_requests": None,
            "ec_load_not_loaded": None, "ec_load_after_alloc_ms": None,
            "ec_load_worker_call_ms": None, "step_ms": None,
            "pd_encoder_iterations": None, "item_digests": None, "correct": None,
            "total": None, "bench_texts_equal": None, "error": None}


def score(results: list[dict], w: dict) -> None:
    """correct/total against the single instance's texts; drops the texts."""
    ref = next((r for r in results if r["row"] == "single" and not r["error"]), None)
    ref_texts, ref_bench = (ref or {}).get("texts"), (ref or {}).get("bench_texts")
    for r in results:
        texts, bench = r.pop("texts", None), r.pop("bench_texts", None)
        if r["error"] and texts is None:
            continue
        r["total"] = len(texts or [])
        if ref_texts is not None and texts is not None:
            r["correct"] = sum(1 for a, b in zip(texts, ref_texts) if a is not None and a == b)
        if ref_bench and bench:
            r["bench_texts_equal"] = sum(1 for a, b in zip(bench, ref_bench)
                                         if a is not None and a == b)


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _triple(d: dict | None, keys=("mean", "median", "p99")) -> str:
    return "-" if not d else " / ".join(_fmt(d.get(k), ".0f" if k != "p50" else ".1f")
                                        for k in keys)


def print_table(results: list[dict], w: dict) -> None:
    flight = f", at most {w['max_concurrency']} in flight" if w.get("max_concurrency") else ""
    items = f"{w['frames']}-frame videos" if is_video(w) else "images"
    print(f"\nworkload: {w['num_prompts']} prompts at rate inf{flight}, random-mm "
          f"{w['images_base']}±{w['images_range_ratio']:g} {items} of {w['image_side']}px "
          f"(max {w['max_images']}), {w['input_len']} text tokens, {w['output_len']} output "
          f"tokens, temperature 0; correctness: {w['correctness_prompts']} fixed requests")
    head = (f"{'connector':<20} {'TTFT ms mean/med/p99':>22} {'TPOT ms mean/med/p99':>21} "
            f"{'req/s':>6} {'EC load ms/item p50/p99/mean':>29} {'in-step p50':>11} "
            f"{'step ms p50/mean':>16} {'PD enc':>6} {'correct':>8}")
    print(head)
    for r in results:
        correct = "-" if r["correct"] is None else f"{r['correct']}/{r['total']}"
        ec, step = r["ec_load_ms_per_item"], r["ec_load_after_alloc_ms"]
        ec_text = "-" if not ec else " / ".join(f"{ec[k]:.2f}" for k in ("p50", "p99", "mean"))
        step_text = "-" if not step else f"{step['p50']:.2f}"
        engine = r.get("step_ms")
        engine_text = "-" if not engine else f"{engine['p50']:.0f} / {engine['mean']:.0f}"
        print(f"{r['connector']:<20} {_triple(r['ttft_ms']):>22} "
              f"{_triple(r['tpot_ms']):>21} {_fmt(r['req_per_s'], '.2f'):>6} {ec_text:>29} "
              f"{step_text:>11} {engine_text:>16} {_fmt(r['pd_encoder_iterations'], 'd'):>6} "
              f"{correct:>8}")
        if r["error"]:
            print(f"    error: {r['error']}")
        if r.get("item_digests"):
            d = r["item_digests"]
            print(f"    items as E computed them: {d['equal']} of {d['items']} equal, "
                  f"{len(d['differ'])} differ, {d['not_saved']} not saved by E")
    print("EC load: first sight of the request on PD's scheduler -> its last item in vLLM's "
          "encoder cache, / items; in-step: per item, from the step that schedules it; "
          "step: PD's engine steps that scheduled work, end of one schedule() to the next")


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''").replace("\n", " ") + "'"


def _label(r: dict) -> str:
    return "single instance" if r["row"] == "single" else r["connector"]


def write_chart(results: list[dict], json_path: Path, w: dict) -> tuple[str | None, str]:
    """Two panels, in bench/charts.cc's style: TTFT (bar median, whisker p99) and EC load per
    item (bar p50, whisker p99) per connector. (png, "") or (None, why not)."""
    gnuplot = shutil.which("gnuplot") or "/usr/bin/gnuplot"
    if not os.access(gnuplot, os.X_OK):
        return None, "no chart: gnuplot is not installed (Debian package gnuplot-nox)"
    ran = [r for r in results if not r["error"]]  # a row that failed has no figures to draw
    ttft = [(_label(r), r["ttft_ms"]["median"], r["ttft_ms"]["p99"]) for r in ran
            if r["ttft_ms"] and r["ttft_ms"]["median"] is not None]
    ec = [(_label(r), r["ec_load_ms_per_item"]["p50"], r["ec_load_ms_per_item"]["p99"])
          for r in ran if r["ec_load_ms_per_item"]]
    if not ttft:
        return None, "no chart: no row ran"
    png = json_path.with_suffix(".png") if json_path.suffix == ".json" else \
        Path(str(json_path) + ".png")
    panels = [("TTFT per request (bar median, whisker p99)", ttft)]
    if ec:
        panels.append(("EC load per item on PD (bar p50, whisker p99)", ec))
    left_out = [_label(r) for r in results if r["error"]]
    items = f"{w['frames']}-frame videos" if is_video(w) else "images"
    title = (f"ecx bench vllm: {w['num_prompts']} prompts, {w['image_side']}px {items}, "
             f"{w['output_len']} output tokens"
             + (f"; not drawn (error): {', '.join(left_out)}" if left_out else ""))
    width = sum(600 + 40 * len(p[1]) for p in panels)
    lines = [f"set terminal pngcairo size {width},640 font ',10'",
             f"set output {_quoted(str(png))}",
             f"set multiplot layout 1,{len(panels)} title {_quoted(title)}",
             "set style fill solid 0.55 border -1", "set boxwidth 0.7", "set grid ytics",
             "set xtics rotate by -40 noenhanced", "set key top left",
             "set rmargin 4", "set bmargin 12"]
    data_files = []
    for i, (name, bars) in enumerate(panels):
        data = png.with_name(f"{png.name}.{i}.dat")
        data.write_text("".join(f"\"{label}\" {v} {max(v, h if h is not None else v)}\n"
                                for label, v, h in bars))
        data_files.append(data)
        # charts.cc's rule: a log scale when the whiskers dwarf the bars
        low = min(v for _, v, _ in bars)
        high = max(max(v, h or v) for _, v, h in bars)
        log_scale = low > 0 and high / low > 50
        lines += [f"set title {_quoted(name)}",
                  f"set ylabel {_quoted('milliseconds' + (' (log scale)' if log_scale else ''))}",
                  "set logscale y" if log_scale else "unset logscale y",
                  "set yrange [*:*]" if log_scale else "set yrange [0:*]",
                  f"set xrange [-0.6:{len(bars) - 0.4}]",
                  f"plot {_quoted(str(data))} using 0:2:xtic(1) with boxes title 'p50', '' "
                  "using 0:2:2:3 with yerrorbars lc rgb 'black' pt 0 title 'p99'"]
    lines.append("unset multiplot")
    script = png.with_name(png.name + ".gp")
    script.write_text("\n".join(lines) + "\n")
    try:
        r = subprocess.run([gnuplot, str(script)], capture_output=True, text=True, timeout=60)
    finally:
        for f in data_files + [script]:
            f.unlink(missing_ok=True)
    if r.returncode != 0:
        return None, f"no chart: gnuplot exited with {r.returncode}: {r.stderr[-300:]}"
    return str(png), ""
