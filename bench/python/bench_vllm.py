"""vLLM's own EC connectors and ECXConnector side by side, driven by `vllm bench serve`.

    python bench/python/bench_vllm.py --json FILE [--quick] [--connectors single,example,...]
    ecx bench vllm --json FILE ...                   (runs this file from the project venv)

Runs, one configuration after another in one run, on this machine, the same workload
(`vllm bench serve --backend openai-chat --dataset-name random-mm`, request rate inf,
temperature 0) against:

  single    one `vllm serve` (no EC connector): the baseline and the correctness reference;
  example   E + PD with ECExampleConnector (safetensors files in a shared folder);
  cpu       E + PD with ECCPUConnector (ec_enable_nixl; NIXL pull through /dev/shm). It
            needs VLLM_USE_V2_MODEL_RUNNER=1, which vLLM's CPU build refuses without a
            Triton CPU backend: the row then carries the error the engines printed;
  mooncake  E + PD with ECMooncakeConnector (ec_buffer_device cpu, mooncake_protocol tcp;
            E pushes into PD's registered pool); the proxy names PD's control address;
  ecx       E + PD with ECXConnector;
  ecx-zc    the same with zero_copy on PD: its encoder cache holds tensors over E's blocks;

every E + PD behind vLLM's example EPD proxy (disagg_epd_proxy.py from vLLM's sdist; scripts/
deps puts it at .venv/share/vllm-examples/; --proxy PATH). The model is the random Qwen2-VL of
tiny_vlm.py (`seed` geometry: hidden 2048, 400 image tokens = 1600 KiB bf16 per 560x560
image; `--quick`: the `tiny` geometry), built once and cached.

Per row: TTFT and TPOT (mean, median, p99) and req/s from `vllm bench serve
--save-result --save-detailed`; EC load time per item (bench_vllm_timing.py: the same
wrapper around every connector, over the bench pass: `ec_load_ms_per_item` from the PD
scheduler's first sight of a request, `ec_load_after_alloc_ms` from the step that schedules
each item, see there); PD encoder iterations
(PD runs with --enable-logging-iteration-details: log lines `encoder inputs: N`, N > 0);
correctness: after the bench pass, a fixed set of requests (1-3 noise images, temperature 0,
fixed max_tokens, ignore_eos) is sent one at a time, and a row is correct on a request when
its text equals the single instance's. `bench_texts_equal` also compares the bench pass's
own texts with the single instance's, request by request (batching can change a greedy
token of a random model, so it is reported, not used as the metric).

Before starting engines for a configuration, the run takes an exclusive flock on
/tmp/ecx-vllm-engines.lock and holds it until they are stopped, so no two engine runs
share the CPUs. Every server runs in its own process group (PR_SET_PDEATHSIG set) and is
stopped by SIGTERM to the group, then SIGKILL after 10 s. Ports are on 127.0.0.1.
With --hosts (root), the run first makes two test hosts (scripts/hosts up 2 --rtt-ms X
--rate R: network namespaces, X ms apart, each host's egress capped at R) and removes them
after: E runs on ecx-h1 (10.77.0.1), PD and the single instance on ecx-h2 (10.77.0.2), each
serving on its host's address (ECXConnector's agents bind it: tcp), the proxy and `vllm
bench serve` on this machine. ECExampleConnector's shared folder is then still one
machine's filesystem, which no two real hosts share: its row is labelled a best case. The
table is followed by the physical limit per item (its bytes at R, plus one RTT) and each
row's EC load as a multiple of it.

Writes the JSON (`{"results": [...], "workload": {...}, "versions": {...}}`), prints a
table, and draws a PNG beside the JSON (gnuplot): TTFT and EC load per connector. A row
that cannot run keeps its place with `error`; the run exits 0 unless it failed itself.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_ecx_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


timing = _sibling("bench_vllm_timing")
rt = _sibling("bench_vllm_runtime")

ROWS = ["single", "example", "cpu", "mooncake", "ecx", "ecx-zc"]
CONNECTOR_CLASS = {"single": None, "example": "ECExampleConnector", "cpu": "ECCPUConnector",
                   "mooncake": "ECMooncakeConnector", "ecx": "ECXConnector",
                   "ecx-zc": "ECXConnector"}

# The seed workload (100 prompts, 3 images of 560x560, 400 text tokens, 100
# output tokens) scaled to what 2 CPU cores finish in minutes per configuration; and a
# video workload: one 16-frame 560x560 video per request, each an item of 8 temporal
# patches x 400 tokens = 3200 x 2048 bf16 = 12.5 MiB, the largest items EPD moves.
# `frames` 1: images (random-mm's buckets are (height, width, frames)).
WORKLOADS = {
    "full": dict(geometry="seed", image_side=560, frames=1, num_prompts=16, input_len=128,
                 output_len=32, images_base=2, images_range_ratio=0.5, max_images=3,
                 correctness_prompts=8, max_model_len=4096, seed=0, max_concurrency=None),
    "quick": dict(geometry="tiny", image_side=112, frames=1, num_prompts=4, input_len=32,
                  output_len=8, images_base=2, images_range_ratio=0.5, max_images=3,
                  correctness_prompts=3, max_model_len=2048, seed=0, max_concurrency=None),
    "video": dict(geometry="seed", image_side=560, frames=16, num_prompts=8, input_len=64,
                  output_len=16, images_base=1, images_range_ratio=0.0, max_images=1,
                  correctness_prompts=4, max_model_len=8192, seed=0, max_concurrency=None),
    "video-quick": dict(geometry="tiny", image_side=112, frames=16, num_prompts=4,
                        input_len=32, output_len=8, images_base=1, images_range_ratio=0.0,
                        max_images=1, correctness_prompts=2, max_model_len=2048, seed=0,
                        max_concurrency=None),
}
POOL_BYTES = 512 << 20  # every connector's pool / buffer / region
# Where each instance runs and the address it serves on: this machine, or with --hosts two
# test hosts (scripts/hosts; E on ecx-h1, PD and the single instance on ecx-h2; the proxy
# and `vllm bench serve` here, which reaches every host directly).
ONE_MACHINE = {"ec_producer": ("127.0.0.1", None), "ec_consumer": ("127.0.0.1", None)}
TEST_HOSTS = {"ec_producer": ("10.77.0.1", "ecx-h1"), "ec_consumer": ("10.77.0.2", "ecx-h2")}


def log(msg: str) -> None:
    print(f"[bench vllm] {msg}", flush=True)


# ---------------------------------------------------------------- configurations

def ec_config(row: str, role: str, cfg: dict, timed: bool) -> dict:
    """--ec-transfer-config for an instance of `row` (role "ec_producer"/"ec_consumer")."""
    name = CONNECTOR_CLASS[row]
    host = cfg["place"][role][0]
    out = {"ec_connector": f"Timed{name}" if timed else name, "ec_role": role,
           "ec_buffer_device": "cpu"}
    if timed:
        out["ec_connector_module_path"] = rt.TIMING_MODULE
    elif row in ("ecx", "ecx-zc"):
        out["ec_connector_module_path"] = "ecx.vllm"
    if row == "example":
        out["ec_connector_extra_config"] = {"shared_storage_path": str(cfg["shared_dir"])}
    elif row == "cpu":
        out["ec_connector_extra_config"] = {"ec_enable_nixl": True, "ec_cpu_bytes": POOL_BYTES}
    elif row == "mooncake":
        port = cfg["mooncake_e_port"] if role == "ec_producer" else cfg["mooncake_pd_port"]
        out.update(ec_ip=host, ec_port=port, ec_buffer_size=POOL_BYTES)
        out["ec_connector_extra_config"] = {"mooncake_protocol": "tcp"}
    elif row in ("ecx", "ecx-zc"):
        out["ec_connector_extra_config"] = {"auth_token_file": str(cfg["token_file"]),
                                            "pool_bytes": f"{POOL_BYTES >> 20}MiB",
                                            "failure_policy": "recompute"}
        if row == "ecx-zc" and role == "ec_consumer":
            out["ec_connector_extra_config"]["zero_copy"] = True
        if role == "ec_producer" and cfg["offer"]:  # the only PD E may offer to
            out["ec_connector_extra_config"]["offer_to"] = [
                f"{cfg['place']['ec_consumer'][0]}:{cfg['ecx_pd_agents']}"]
        if role == "ec_consumer" and cfg["offer"]:
            # Fixed ports (its scheduler's: the base), so that the proxy can name PD's
            # scheduler to E, which offers it the items early.
            out["ec_connector_extra_config"]["tcp_port"] = cfg["ecx_pd_agents"]
        if host != "127.0.0.1":  # its agents listen on its host's address
            out["ec_connector_extra_config"]["tcp_host"] = host
        out["ec_connector_extra_config"].update(cfg["ecx_extra"])
    return out


def worker_cores(role: str) -> str | None:
    """The cores E's or PD's worker is bound to (VLLM_CPU_OMP_THREADS_BIND), disjoint.
    Left to vLLM ("auto"), every instance binds its worker to the same first core: E's and
    PD's workers then share one core while the other idles, and E's worker, which spins
    (sched_yield) for a second after each step, starves PD's worker of the wake-up for
    PD's next step for as long (HISTORY.md §30). A deployment gives each instance cores
    of its own; so does the bench: PD the first half of this process's cores, E the rest.
    None (vLLM's default) with a single core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    mine = cores[:half] if role == "ec_consumer" else cores[half:]
    return ",".join(str(c) for c in mine)


def row_env(row: str, role: str, cfg: dict) -> dict:
    host = cfg["place"][role][0]
    env = {"VLLM_HOST_IP": host}
    cores = worker_cores(role)
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    if row == "cpu":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        if role == "ec_producer":
            env.update(VLLM_EC_SIDE_CHANNEL_HOST=host,
                       VLLM_EC_SIDE_CHANNEL_PORT=str(cfg["side_channel_port"]))
    if role == "ec_consumer" and cfg["timed"]:
        env[timing.ENV] = str(cfg["timing_file"])  # only PD's scheduler sights loads
    if cfg["timed"] and cfg["item_digests"]:
        # Both sides: E records what it computed, PD what reached vLLM's cache.
        env.update({timing.ENV: str(cfg["timing_file"]), timing.DIGESTS_ENV: "1"})
    return env


def run_row(row: str, args, w: dict, model: Path, run_dir: Path, fixed: list[dict]) -> dict:
    label = "ECXConnector zero_copy" if row == "ecx-zc" else CONNECTOR_CLASS[row] or "single"
    place = TEST_HOSTS if args.hosts else ONE_MACHINE
    if args.hosts and row == "example":
        label += " (one machine's folder: a best case)"
    result = rt.empty_row(label, row)
    d = run_dir / row
    d.mkdir(parents=True, exist_ok=True)
    result["logs"] = str(d)
    cfg = {"timed": not args.no_timing, "item_digests": args.item_digests,
           "shared_dir": d / "ec_cache",
           "token_file": run_dir / "ecx_token", "timing_file": d / "timing.jsonl",
           "mooncake_e_port": rt.free_port(), "mooncake_pd_port": rt.free_port(),
           "side_channel_port": rt.free_port(), "place": place,
           "ecx_extra": json.loads(args.ecx_extra),
           "offer": row in ("ecx", "ecx-zc") and args.offer,
           "ecx_pd_agents": rt.free_ports(2)}
    (e_host, e_ns), (pd_host, pd_ns) = place["ec_producer"], place["ec_consumer"]
    cfg["shared_dir"].mkdir(exist_ok=True)
    common = ["--max-model-len", str(w["max_model_len"]),
              "--limit-mm-per-prompt", json.dumps(rt.mm_limits(w))]
    procs: list[rt.Proc] = []
    with rt.EngineLock(args.lock_timeout):
        try:
            if row == "single":
                port = rt.free_port()
                pd = rt.Proc("single", rt.serve_argv(model, port, *common,
                             "--enable-logging-iteration-details", host=pd_host),
                             rt.vllm_env(VLLM_HOST_IP=pd_host), port, d / "single.log",
                             host=pd_host, netns=pd_ns)
                procs.append(pd.start())
                rt.wait_all([pd], args.start_timeout)
                front = pd
            else:
                e_port, pd_port = rt.free_port(), rt.free_port()
                e = rt.Proc("E", rt.serve_argv(
                    model, e_port, *common, "--no-enable-prefix-caching",
                    "--max-num-batched-tokens", "16384", "--enable-request-id-headers",
                    "--ec-transfer-config", json.dumps(ec_config(row, "ec_producer", cfg,
                                                                 cfg["timed"])),
                    host=e_host),
                    rt.vllm_env(**row_env(row, "ec_producer", cfg)), e_port, d / "e.log",
                    host=e_host, netns=e_ns)
                pd = rt.Proc("PD", rt.serve_argv(
                    model, pd_port, *common, "--enable-request-id-headers",
                    "--enable-logging-iteration-details",
                    "--ec-transfer-config", json.dumps(ec_config(row, "ec_consumer", cfg,
                                                                 cfg["timed"])),
                    host=pd_host),
                    rt.vllm_env(**row_env(row, "ec_consumer", cfg)), pd_port, d / "pd.log",
                    host=pd_host, netns=pd_ns)
                procs += [e.start(), pd.start()]
                rt.wait_all([e, pd], args.start_timeout)
                proxy_port = rt.free_port()
                proxy_argv = [sys.executable, str(args.proxy), "--host", "127.0.0.1",
                              "--port", str(proxy_port), "--encode-servers-urls", e.url,
                              "--decode-servers-urls", pd.url]
                if row == "mooncake":
                    proxy_argv += ["--ec-consumer-zmq-addrs",
                                   f"tcp://{pd_host}:{cfg['mooncake_pd_port']}"]
                elif cfg["offer"]:  # E offers PD's scheduler the items (ECXConnector)
                    proxy_argv += ["--ec-consumer-zmq-addrs",
                                   f"{pd_host}:{cfg['ecx_pd_agents']}"]
                front = rt.Proc("proxy", proxy_argv, rt.vllm_env(), proxy_port,
                                d / "proxy.log")
                procs.append(front.start())
                rt.wait_all([front], 120)
            log(f"{row}: up; vllm bench serve ({w['num_prompts']} prompts)")
            t0 = time.time()
            bench = rt.bench_serve(front.url, model, w, d, args.bench_timeout)
            t1 = time.time()
            result.update(rt.bench_figures(bench))
            if not result["output_tokens"]:
                # vLLM answered 200 and streamed an error finish, which bench serve counts
                # a success, or the requests failed: say what the engines logged, and skip
                # the correctness pass.
                why = [f"PD log: {rt.first_log_error(pd.log_text(True)) or 'no error'}"]
                e_error = rt.root_error(e.log_text(True)) if row != "single" else None
                if e_error:
                    why.append(f"E log: {e_error}")
                result["error"] = (
                    f"no generated token: {result['completed']} of {w['num_prompts']} requests "
                    f"answered without one (mean TTFT {(result['ttft_ms']['mean'] or 0) / 1000:.1f}"
                    f" s), {result['failed']} failed ({result.get('bench_error') or '-'}); "
                    + "; ".join(why))
                log(f"{row}: {result['error']}")
            else:
                log(f"{row}: correctness pass ({len(fixed)} requests, one at a time)")
                result["texts"] = [rt.chat(front.url, body, args.request_timeout)
                                   for body in fixed]
            result["pd_encoder_iterations"] = pd.encoder_iterations()
            if row != "single" and cfg["timed"]:
                events = timing.read_events(str(cfg["timing_file"]))
                stats = timing.ec_load_stats(events, t0, t1)
                result["item_digests"] = timing.item_digests(events)
                result["ec_load_ms_per_item"] = stats["from_sight"]
                result["ec_load_after_alloc_ms"] = stats["from_alloc"]
                result["ec_load_worker_call_ms"] = stats["worker_call"]
                result["ec_load_requests"] = stats["requests"]
                result["ec_load_not_loaded"] = stats["not_loaded"]
                result["step_ms"] = timing.step_stats(events, t0, t1)
                phases = timing.dispatch_phases(events, t0, t1)  # $ECX_BENCH_PHASES=1
                if phases is not None:
                    result["dispatch_phases_ms"] = phases
        except Exception as exc:  # noqa: BLE001 - the row reports it, the run goes on
            result["error"] = rt.describe(exc, procs)
            log(f"{row}: {result['error']}")
        finally:
            for p in reversed(procs):
                p.stop()
            # ECExampleConnector never deletes its files (1600 KiB per item): drop them.
            shutil.rmtree(cfg["shared_dir"], ignore_errors=True)
    return result


# ---------------------------------------------------------------- test hosts

HOSTS_SCRIPT = HERE.parents[1] / "scripts" / "hosts"


class TestHosts:
    """ecx-h1 and ecx-h2 for the run (`scripts/hosts up 2`), RTT and egress rate as given;
    down at its end, however it ends."""

    def __init__(self, rtt_ms: float, rate: str):
        self.rtt_ms, self.rate = rtt_ms, rate

    def _run(self, *args: str) -> None:
        out = subprocess.run([str(HOSTS_SCRIPT), *args], capture_output=True, text=True,
                             timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"scripts/hosts {' '.join(args)}: {out.stdout}{out.stderr}")
        log(out.stdout.strip().splitlines()[0] if out.stdout.strip() else "scripts/hosts")

    def __enter__(self) -> "TestHosts":
        self._run("up", "2", "--rtt-ms", f"{self.rtt_ms:g}", "--rate", self.rate)
        return self

    def __exit__(self, *exc) -> None:
        self._run("down")


def rate_bits(rate: str) -> float:
    """tc's rate ("10gbit", "800mbit"): bits per second (SI prefixes, as tc's)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"--rate {rate!r}: give bits per second as tc does, e.g. 10gbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]


def item_bytes(model: Path, w: dict) -> int:
    """One item's bytes in vLLM's encoder cache under this workload: Qwen2-VL's merged
    patches (28 px a side, two frames a temporal patch) x the model's width, bf16."""
    config = json.loads((model / "config.json").read_text())
    width = config.get("hidden_size") or config["text_config"]["hidden_size"]
    return (w["image_side"] // 28) ** 2 * max(1, w["frames"] // 2) * width * 2


def physical_limit(model: Path, w: dict, rtt_ms: float, rate: str) -> dict:
    """The least an item can take from E's host to PD's: its bytes at the egress rate,
    plus one round trip (the request for them)."""
    size = item_bytes(model, w)
    return {"item_bytes": size, "rate": rate, "rtt_ms": rtt_ms,
            "limit_ms": size * 8 / rate_bits(rate) * 1e3 + rtt_ms}


def against_limit(results: list[dict], limit: dict) -> None:
    """Each row's EC load per item as a multiple of the physical limit."""
    for r in results:
        ec = r.get("ec_load_ms_per_item")
        if ec:
            r["ec_load_vs_limit"] = {k: ec[k] / limit["limit_ms"] for k in ("p50", "mean")}
    print(f"physical limit per item between the hosts: {limit['limit_ms']:.2f} ms "
          f"({limit['item_bytes']} bytes at {limit['rate']} + 1 RTT of {limit['rtt_ms']:g} ms)")
    for r in results:
        if r.get("ec_load_vs_limit"):
            v = r["ec_load_vs_limit"]
            print(f"  {r['connector']:<44} EC load p50 {v['p50']:.2f}x, mean {v['mean']:.2f}x "
                  "the limit")


# ---------------------------------------------------------------- the run

def ensure_model(geometry: str, cache: Path, given: str | None) -> Path:
    if given:
        return Path(given).resolve()
    # Keyed by the generator's bytes too: a changed tiny_vlm.py builds a new model.
    digest = hashlib.sha256(b"".join((HERE / f).read_bytes() for f in (
        "tiny_vlm.py", "tiny_vlm_families.py"))).hexdigest()[:12]
    out = cache / f"tiny-vlm-{geometry}-seed0-{digest}"
    if (out / "config.json").is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=cache))
    log(f"building the {geometry} model ({HERE / 'tiny_vlm.py'}) into {out}")
    subprocess.run([sys.executable, str(HERE / "tiny_vlm.py"), str(tmp / "m"), "--geometry",
                    geometry, "--seed", "0"], check=True, timeout=1800)
    os.replace(tmp / "m", out)
    tmp.rmdir()
    return out


def ensure_mooncake(no_install: bool) -> None:
    """Installs Mooncake's engine (peers.py install: the pinned peers) when it is missing.
    The row runs either way: when it still cannot import, vLLM's own error is the row's."""
    if importlib.util.find_spec("mooncake") is not None or no_install:
        return
    log("installing the pinned peers (Mooncake) into this venv: peers.py install")
    r = subprocess.run([sys.executable, str(HERE / "peers.py"), "install"],
                       capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        log("peers.py install failed: " + (r.stderr + r.stdout)[-400:])


def versions(args) -> dict:
    from importlib import metadata
    out = {"python": sys.version.split()[0]}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "ecx",
                 "mooncake-transfer-engine-non-cuda", "nixl-cu12"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        out["proxy_sha256"] = hashlib.sha256(Path(args.proxy).read_bytes()).hexdigest()[:16]
    except OSError:
        pass
    try:
        out["ecx_commit"] = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
            text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="bench_vllm.json", help="results (a PNG beside it)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tiny geometry, 4 prompts, 8 output tokens")
    p.add_argument("--workload", choices=("image", "video"), default="image",
                   help="image: random-mm images (the seed's shape); video: one 16-frame "
                        "video per request (items of 12.5 MiB; --quick: 112 px frames)")
    p.add_argument("--connectors", default=",".join(ROWS),
                   help=f"rows, in this order: {','.join(ROWS)}")
    p.add_argument("--proxy", default=str(Path(sys.prefix) / "share" / "vllm-examples" /
                                          "disagg_epd_proxy.py"),
                   help="vLLM's example EPD proxy (disagg_epd_proxy.py)")
    p.add_argument("--model", help="a model directory (default: tiny_vlm.py, built and cached)")
    p.add_argument("--model-cache", default=str(Path(tempfile.gettempdir()) /
                                                "ecx-bench-vllm-models"))
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--input-len", type=int, help="random text tokens per prompt")
    p.add_argument("--output-len", type=int)
    p.add_argument("--images", type=int, help="base images per request (random-mm)")
    p.add_argument("--correctness-prompts", type=int)
    p.add_argument("--max-concurrency", type=int,
                   help="requests in flight at most (vllm bench serve's; default: all at once)")
    p.add_argument("--no-timing", action="store_true",
                   help="load the connectors themselves, not the timed subclasses")
    p.add_argument("--item-digests", action="store_true",
                   help="SHA-256 of every item as E computed it and as it entered PD's "
                        "encoder cache, compared per row (costs time on both sides)")
    p.add_argument("--no-install", action="store_true",
                   help="do not pip-install Mooncake (peers.py install) when it is missing")
    p.add_argument("--keep-logs", action="store_true", help="keep the run directory")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--bench-timeout", type=float, default=3600)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--lock-timeout", type=float, default=7200)
    p.add_argument("--ecx-extra", default="{}",
                   help="JSON merged into the ECXConnector rows' ec_connector_extra_config "
                        "(E's and PD's), e.g. '{\"first_look_wait_ms\": 40}'")
    p.add_argument("--offer", action="store_true",
                   help="ECXConnector rows: the proxy names PD's scheduler to E "
                        "(--ec-consumer-zmq-addrs), which offers PD the items early")
    p.add_argument("--hosts", action="store_true",
                   help="E on test host ecx-h1, PD on ecx-h2 (scripts/hosts, made for the run "
                        "and removed after; root): the items cross a network")
    p.add_argument("--rtt-ms", type=float, default=1.0, help="--hosts: RTT between the hosts")
    p.add_argument("--rate", default="10gbit", help="--hosts: each host's egress (tc's units)")
    args = p.parse_args(argv)
    try:
        if not isinstance(json.loads(args.ecx_extra), dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        p.error(f"--ecx-extra: {e}")
    if args.hosts:
        try:
            rate_bits(args.rate)
        except ValueError as e:
            p.error(str(e))
        if os.geteuid() != 0:
            p.error("--hosts needs root (network namespaces)")

    rows = [r.strip() for r in args.connectors.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {ROWS}")
    name = {"image": "full", "video": "video"}[args.workload]
    w = dict(WORKLOADS[name + "-quick" if args.quick and args.workload == "video" else
                       "quick" if args.quick else name])
    for key, value in (("num_prompts", args.num_prompts), ("input_len", args.input_len),
                       ("output_len", args.output_len), ("images_base", args.images),
                       ("correctness_prompts", args.correctness_prompts),
                       ("max_concurrency", args.max_concurrency)):
        if value is not None:
            w[key] = value
    if not (Path(sys.prefix) / "bin" / "vllm").exists():
        print(f"bench vllm: no vllm in {sys.prefix} (scripts/deps installs vllm-cpu)",
              file=sys.stderr)
        return 1
    if any(r != "single" for r in rows) and not Path(args.proxy).is_file():
        print(f"bench vllm: no EPD proxy at {args.proxy} (scripts/deps puts vLLM's there; "
              "or pass --proxy)", file=sys.stderr)
        return 1

    run_dir = Path(tempfile.mkdtemp(prefix="ecx-bench-vllm-"))
    rt.install_timing_module(run_dir, HERE / "bench_vllm_timing.py")
    token = run_dir / "ecx_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    rt.install_signal_handlers()
    model = ensure_model(w["geometry"], Path(args.model_cache), args.model)
    if "mooncake" in rows:
        ensure_mooncake(args.no_install)
    fixed = rt.fixed_requests(w)
    log(f"workload: {json.dumps(w)}; model {model}; logs {run_dir}")

    results = []
    with TestHosts(args.rtt_ms, args.rate) if args.hosts else contextlib.nullcontext():
        for row in rows:
            log(f"{row}: starting")
            results.append(run_row(row, args, w, model, run_dir, fixed))
    rt.score(results, w)
    limit = physical_limit(model, w, args.rtt_ms, args.rate) if args.hosts else None
    report = {"results": results,
              "workload": {**w, "modality": args.workload, "model": str(model),
                           "request_rate": "inf", "temperature": 0,
                           "dataset": "random-mm", "backend": "openai-chat",
                           "proxy": str(args.proxy), "timed": not args.no_timing,
                           "ecx_extra": json.loads(args.ecx_extra),
                           "ecx_offer": args.offer},
              "placement": ({"E": "ecx-h1 (10.77.0.1)", "PD": "ecx-h2 (10.77.0.2)",
                             "proxy": "this machine", **(limit or {})} if args.hosts else
                            {"all": "this machine, 127.0.0.1"})
              | {"worker_cores": {"E": worker_cores("ec_producer") or "vLLM's auto",
                                  "PD": worker_cores("ec_consumer") or "vLLM's auto"}},
              "versions": versions(args)}
    rt.print_table(results, w)
    if limit:
        against_limit(results, limit)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    png, why = rt.write_chart(results, out, w)
    print(f"wrote {png}" if png else why)
    if not args.keep_logs and not any(r["error"] for r in results):
        shutil.rmtree(run_dir, ignore_errors=True)
        for r in results:
            r.pop("logs", None)
        out.write_text(json.dumps(report, indent=2) + "\n")
    else:
        print(f"logs kept in {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
