"""ECXConnector inside real `vllm serve` engines on two test hosts, and a network that
fails (scripts/hosts: network namespaces on one bridge, 1 ms RTT through ecx's relay).

E (ec_producer) runs on ecx-h1, PD (ec_consumer, policy recompute) on ecx-h2, each with
its agents bound to its host's address and a fixed tcp_port, over tcp with a deployment
secret; the proxies and the test run in the root namespace, which reaches every host
directly. The answers are compared with the session's single instance. In order (the
engines are shared; each test leaves them serving):

- served: through `ecx serve proxy --upstream-api vllm` and through vLLM's example EPD
  proxy, every answer is the single instance's, PD runs no encoder, each item is loaded
  from the other host, and E's pins go back to 0;
- the link cut: PD's host drops everything to and from E's (nft) for 10 s while requests
  run: each ends within its deadline with the right text (PD encodes what it could not
  load), no engine dies, and once the link is back PD loads from E again;
- E killed and started again with the same command on the same address: while it is
  down, requests still get the right text (the proxy leaves the images to PD); once it is
  up, PD loads from the new E, and nothing else was restarted;
- PD killed mid-load: E's pins for it end by the lease, and E serves on.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_engines import (
    Engine,
    ec_config,
    encode_on,
    free_port,
    metric,
    png,
    post,
    running,
    serve_argv,
    vllm_env,
    wait_until,
    warm_up,
)
from vllm_reference import chat_body, fresh, images_of

from ecx_stack import REPO_ROOT, EcxStack, Service, service_argv

HOSTS = REPO_ROOT / "scripts" / "hosts"
EXAMPLE_PROXY = Path(os.environ.get("ECX_VLLM_EPD_PROXY") or Path(
    sys.executable).parent.parent / "share" / "vllm-examples" / "disagg_epd_proxy.py")
E_HOST, PD_HOST = "10.77.0.1", "10.77.0.2"
E2_HOST, PD2_HOST = "10.77.0.3", "10.77.0.4"  # the N x M test's second E and PD
LOAD_TIMEOUT_MS = 4000  # PD's: a load over the cut link gives up by then
LEASE_MS = 6000  # E's: the pins of a PD that died end by then
CUT_S = 10


def hosts(*args: str, ecx: Path) -> str:
    out = subprocess.run([str(HOSTS), *args], env={**os.environ, "ECX_BIN": str(ecx)},
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"scripts/hosts {' '.join(args)}: {out.stdout}{out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def test_hosts(ecx_binary):
    """ecx-h1..ecx-h4, 1 ms apart; removed at the end, however the module ends."""
    if os.geteuid() != 0:
        pytest.fail("the test hosts need root (network namespaces)", pytrace=False)
    hosts("up", "4", "--rtt-ms", "1", ecx=ecx_binary)
    try:
        yield
    finally:
        hosts("down", ecx=ecx_binary)


def netns_of(host: str) -> str:
    return "ecx-h" + host.rsplit(".", 1)[1]


def e_engine(model, secret, logs: Path, port: int, tcp_port: int, metrics_port: int,
             name: str = "e", host: str = E_HOST) -> Engine:
    extra = {"auth_token_file": secret, "pool_bytes": "256MiB", "tcp_host": host,
             "tcp_port": tcp_port, "lease_ms": LEASE_MS, "metrics_port": metrics_port,
             "metrics_host": host}
    return Engine(name, serve_argv(model, port, "--ec-transfer-config",
                                   ec_config("ec_producer", extra), host=host),
                  vllm_env(), port, logs / f"{name}.log", metrics_port=metrics_port,
                  host=host, netns=netns_of(host))


def pd_engine(model, secret, logs: Path, name: str, host: str) -> Engine:
    extra = {"auth_token_file": secret, "pool_bytes": "256MiB", "tcp_host": host,
             "tcp_port": 7100, "load_timeout_ms": LOAD_TIMEOUT_MS, "lease_ms": LEASE_MS,
             "metrics_port": 9100, "metrics_host": host}
    return Engine(name, serve_argv(model, 8000, "--enable-logging-iteration-details",
                                   "--ec-transfer-config", ec_config("ec_consumer", extra),
                                   host=host),
                  vllm_env(), 8000, logs / f"{name}.log", metrics_port=9100, host=host,
                  netns=netns_of(host))


@pytest.fixture(scope="module")
def epd_hosts(test_hosts, tiny_model, deployment_secret, reference, tmp_path_factory):
    """E on ecx-h1 and PD on ecx-h2, a second E on ecx-h3 and PD on ecx-h4 (each host has
    all its ports to itself); the tests but the N x M one use the first pair."""
    logs = tmp_path_factory.mktemp("epd-hosts")
    e = e_engine(tiny_model, deployment_secret, logs, 8000, 7100, 9100)
    pd = pd_engine(tiny_model, deployment_secret, logs, "pd", PD_HOST)
    e2 = e_engine(tiny_model, deployment_secret, logs, 8000, 7100, 9100, "e2", E2_HOST)
    pd2 = pd_engine(tiny_model, deployment_secret, logs, "pd2", PD2_HOST)
    engines = {"e": e, "pd": pd, "e2": e2, "pd2": pd2, "logs": logs, "model": tiny_model,
               "secret": deployment_secret}
    try:
        with running(e, pd, e2, pd2):
            reference.engine.wait_ready()
            # Each PD's first connection to each E.
            for k, (enc, dec) in enumerate(((e, pd), (e2, pd), (e, pd2), (e2, pd2))):
                warm_up(enc, dec, png(434343 + k))
            yield engines
    finally:  # E may have been replaced by its restart
        engines["e"].stop()


def text_of(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def loads(pd: Engine) -> float:
    return metric(pd.metrics(), "vllm:ecx_loads_total")


def e_pins(e: Engine) -> float:
    return metric(e.worker_metrics(0), "ecx_pool_pins")


def pins_settle(e: Engine, timeout: float = 30) -> None:
    wait_until(lambda: e_pins(e) == 0, timeout, "E's pins back to 0")


def ecx_proxy(stack: EcxStack, e: Engine, pd: Engine):
    return stack.start("proxy", "--upstream-api", "vllm", "--encoders", e.url, "--pd", pd.url,
                       "--model", "tiny-vlm")


def proxy_health(proxy) -> dict:
    with urllib.request.urlopen(proxy.url + "/health", timeout=10) as r:
        return json.loads(r.read())


def ask_loaded(proxy_url: str, pd: Engine, index: int, reference, why: str) -> None:
    """A request through the proxy: the single instance's text, and every item of it
    loaded by PD (counted), none encoded there."""
    pd.mark_log()
    before = loads(pd)
    status, body, _ = ask(proxy_url, index)
    assert status == 200, body
    assert text_of(body) == reference.text(index), f"request {index}: {why}"
    assert pd.encoder_iterations() == 0, f"PD encoded: {why}"
    items = len(images_of(index))
    wait_until(lambda: loads(pd) >= before + items, 30, f"PD counted {items} loads: {why}")


def ask(url: str, index: int, timeout: float = 300) -> tuple[int, dict, float]:
    started = time.monotonic()
    status, body = post(url + "/v1/chat/completions", chat_body(index), timeout=timeout)
    return status, body, time.monotonic() - started


def test_across_hosts_both_proxies_serve_with_items_loaded_from_the_other_host(
        epd_hosts, reference, ecx_binary, tmp_path):
    e, pd = epd_hosts["e"], epd_hosts["pd"]
    # The agent each process logged: E's agents listen on E's host, at the fixed ports.
    assert f"{E_HOST}:7100" in e.log_text() and f"{E_HOST}:7101" in e.log_text(), \
        e.log_tail()
    pd.mark_log()
    before = loads(pd)
    with EcxStack(ecx_binary, tmp_path) as stack:
        proxy = ecx_proxy(stack, e, pd)
        for i in (0, 2, 3):
            status, body, _ = ask(proxy.url, i)
            assert status == 200, body
            assert text_of(body) == reference.text(i), f"request {i} through ecx's proxy"
    port = free_port()
    example = Engine("vllm-proxy", [sys.executable, str(EXAMPLE_PROXY), "--host", "127.0.0.1",
                                    "--port", str(port), "--encode-servers-urls", e.url,
                                    "--decode-servers-urls", pd.url],
                     vllm_env(), port, tmp_path / "proxy.log", ready_marker=b"Uvicorn running on")
    with running(example):
        for i in (1, 5):
            status, body, _ = ask(example.url, i)
            assert status == 200, body
            assert text_of(body) == reference.text(i), f"request {i} through vLLM's proxy"
    assert pd.encoder_iterations() == 0, "PD ran its encoder"
    # 1 + 2 + 3 images (ecx's proxy), 1 + 2 (vLLM's): each read from E's host.
    wait_until(lambda: loads(pd) >= before + 9, 30, "PD counted 9 loads")
    # Each READ across hosts was timed by the agent that issued it: PD's scheduler.
    reads = metric(pd.metrics(pd.metrics_port), "ecx_transfer_seconds_count", op="read")
    assert reads >= 5, f"{reads} timed reads (one per request at least)"
    pins_settle(e)


@pytest.fixture(scope="module")
def etcd(test_hosts, tmp_path_factory):
    """An etcd the test hosts reach (on the root namespace's address on their bridge)."""
    data = tmp_path_factory.mktemp("etcd")
    port, peer = free_port(), free_port()
    url = f"http://10.77.0.253:{port}"
    log = open(data / "etcd.log", "wb")
    proc = subprocess.Popen(["etcd", "--data-dir", str(data / "data"), "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls",
                             f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
                             f"http://127.0.0.1:{peer}", "--initial-cluster",
                             f"default=http://127.0.0.1:{peer}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: _answers(url + "/health"), 30, "etcd serves")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def sidecar(ecx: Path, logs: Path, engine: Engine, role: str, etcd_url: str,
            secret: str) -> Service:
    """`ecx serve sidecar` on the engine's host, registering it for `role`."""
    argv = ["ip", "netns", "exec", engine.netns,
            *service_argv(ecx, "sidecar", ["--host", engine.host, "--role", role,
                                           "--instance-url", engine.url, "--model", "tiny-vlm",
                                           "--etcd", etcd_url, "--auth-token-file", secret,
                                           "--log-level", "info"])]
    service = Service("sidecar", argv, logs)
    try:
        service.wait_until_listening()
    except BaseException:
        service.stop()
        raise
    return service


def upstreams(proxy) -> list[dict]:
    with urllib.request.urlopen(proxy.url + "/v1/upstreams", timeout=10) as r:
        return json.loads(r.read())["upstreams"]


def members_up(proxy, role: str) -> int:
    return sum(1 for u in upstreams(proxy) if u["role"] == role and u["reachable"] and
               u.get("proven", True))


def test_two_encoders_and_two_pds_on_four_hosts_behind_either_proxy(epd_hosts, reference,
                                                                   ecx_binary, tmp_path):
    """N x M: every request gets the single instance's text, no PD encodes, both encoders
    encode and both PDs answer (ecx's proxy: images by content, PDs by fewest in flight;
    vLLM's: round robin), and every pin at both encoders ends."""
    es, pds = [epd_hosts["e"], epd_hosts["e2"]], [epd_hosts["pd"], epd_hosts["pd2"]]
    batch = [fresh(250 + k, n_images=2) for k in range(8)]
    for i in batch:
        reference.text(i)
    for pd in pds:
        pd.mark_log()
    saves = [metric(e.worker_metrics(0), "ecx_saves_total") for e in es]
    served = [metric(pd.metrics(), "vllm:request_success_total") for pd in pds]
    with EcxStack(ecx_binary, tmp_path) as stack:
        proxy = stack.start("proxy", "--upstream-api", "vllm", "--model", "tiny-vlm",
                            "--encoders", ",".join(e.url for e in es),
                            "--pd", ",".join(pd.url for pd in pds))
        answers = asked_together(proxy.url, batch[:6])
    port = free_port()
    example = Engine("vllm-proxy", [sys.executable, str(EXAMPLE_PROXY), "--host", "127.0.0.1",
                                    "--port", str(port), "--encode-servers-urls",
                                    ",".join(e.url for e in es), "--decode-servers-urls",
                                    ",".join(pd.url for pd in pds)],
                     vllm_env(), port, tmp_path / "proxy.log", ready_marker=b"Uvicorn running on")
    with running(example):
        answers += [ask(example.url, i) for i in batch[6:]]
    for i, (status, body, _) in zip(batch, answers):
        assert status == 200, body
        assert text_of(body) == reference.text(i), f"request {i}"
    for pd in pds:
        assert pd.encoder_iterations() == 0, f"{pd.name} ran its encoder"
    for e, before in zip(es, saves):
        assert metric(e.worker_metrics(0), "ecx_saves_total") > before, f"{e.name} encoded nothing"
    for pd, before in zip(pds, served):
        wait_until(lambda: metric(pd.metrics(), "vllm:request_success_total") > before, 30,
                   f"{pd.name} answered some of the requests")
    for e in es:
        pins_settle(e)


def test_vllm_instances_join_and_leave_the_membership_through_their_sidecars(
        epd_hosts, etcd, reference, ecx_binary, tmp_path):
    """A proxy that knows no instance but etcd: each engine's sidecar registers it, the
    proxy proves them and routes; a sidecar stopped takes its engine out, a new one puts
    it back, and the proxy is never restarted."""
    e, pd, secret = epd_hosts["e"], epd_hosts["pd"], epd_hosts["secret"]
    first, during, back = fresh(240), fresh(241), fresh(242)
    for i in (first, during, back):
        reference.text(i)
    e_side = sidecar(ecx_binary, tmp_path, e, "encoder", etcd, secret)
    pd_side = sidecar(ecx_binary, tmp_path, pd, "pd", etcd, secret)
    try:
        with EcxStack(ecx_binary, tmp_path) as stack:
            proxy = stack.start("proxy", "--upstream-api", "vllm", "--etcd", etcd, "--model",
                                "tiny-vlm", "--auth-token-file", secret)
            wait_until(lambda: members_up(proxy, "encoder") == 1 and members_up(proxy, "pd") == 1,
                       30, "the proxy routes to both engines, found in etcd")
            listed = {u["role"]: u["url"] for u in upstreams(proxy)}
            assert listed == {"encoder": e.url, "pd": pd.url}, listed
            ask_loaded(proxy.url, pd, first, reference, "E found in etcd")
            # E's sidecar stops: E leaves; the proxy leaves the images to PD.
            e_side.stop()
            wait_until(lambda: not any(u["role"] == "encoder" for u in upstreams(proxy)), 30,
                       "E left the proxy's members")
            status, body, _ = ask(proxy.url, during)
            assert status == 200, body
            assert text_of(body) == reference.text(during)
            # A new sidecar: E is back, proven again, and used.
            e_side = sidecar(ecx_binary, tmp_path, e, "encoder", etcd, secret)
            wait_until(lambda: members_up(proxy, "encoder") == 1, 30, "E back in the members")
            ask_loaded(proxy.url, pd, back, reference, "E rejoined")
    finally:
        e_side.stop()
        pd_side.stop()
    pins_settle(e)


def cut(netns: str, peer: str) -> None:
    """Everything between `netns` and the host at `peer` dropped, both ways."""
    rules = (f"table inet ecx_cut {{\n"
             f"  chain out {{ type filter hook output priority 0; ip daddr {peer} drop; }}\n"
             f"  chain in {{ type filter hook input priority 0; ip saddr {peer} drop; }}\n"
             f"}}\n")
    subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=rules, text=True,
                   check=True, timeout=30)


def uncut(netns: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, "nft", "delete", "table", "inet", "ecx_cut"],
                   check=True, timeout=30)


def asked_together(url: str, indices: list[int]) -> list[tuple[int, dict, float]]:
    out: list = [None] * len(indices)

    def one(k: int) -> None:
        try:
            out[k] = ask(url, indices[k], timeout=120)
        except Exception as e:  # noqa: BLE001 (reported by the assertions below)
            out[k] = (0, {"error": repr(e)}, 0.0)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(indices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


def test_a_cut_link_under_load_ends_every_request_in_time_and_pd_loads_again_after(
        epd_hosts, reference, ecx_binary, tmp_path):
    e, pd = epd_hosts["e"], epd_hosts["pd"]
    batch = [fresh(200 + k, n_images=2) for k in range(4)]
    after = fresh(210)
    for i in (*batch, after):
        reference.text(i)
    local = metric(pd.metrics(), "vllm:ecx_local_encodes_total")
    with EcxStack(ecx_binary, tmp_path) as stack:
        proxy = ecx_proxy(stack, e, pd)
        cut("ecx-h2", E_HOST)
        try:
            started = time.monotonic()
            answers = asked_together(proxy.url, batch)
            assert time.monotonic() - started < CUT_S + 60, "the batch outlived its deadline"
        finally:
            uncut("ecx-h2")
        for i, (status, body, seconds) in zip(batch, answers):
            assert status == 200, body
            assert text_of(body) == reference.text(i), f"request {i} during the cut"
            # The load deadline, then PD's own encode and decode (two images, 8 tokens).
            assert seconds < LOAD_TIMEOUT_MS / 1000 + 60, f"request {i} took {seconds:.1f} s"
        # What PD could not load it encoded (each request's two images).
        wait_until(lambda: metric(pd.metrics(), "vllm:ecx_local_encodes_total") >= local + 8,
                   30, "PD counted 8 local encodes")
        assert e.alive() and pd.alive()
        # The link back: the next request's items are loaded from E again.
        ask_loaded(proxy.url, pd, after, reference, "after the link came back")
    pins_settle(e, LEASE_MS / 1000 + 30)


def sidecar_metric(service: Service, name: str) -> float:
    with urllib.request.urlopen(service.url + "/metrics", timeout=10) as r:
        return metric(r.read().decode(), name)


def test_an_encoder_restarted_on_its_address_is_used_again(epd_hosts, etcd, reference,
                                                           ecx_binary, tmp_path):
    """Also: its sidecar deregisters it while it is down, and registers it again after."""
    e, pd = epd_hosts["e"], epd_hosts["pd"]
    down, back = fresh(220, n_images=2), fresh(221, n_images=2)
    for i in (down, back):
        reference.text(i)
    side = sidecar(ecx_binary, tmp_path, e, "encoder", etcd, epd_hosts["secret"])
    with side, EcxStack(ecx_binary, tmp_path) as stack:
        wait_until(lambda: sidecar_metric(side, "ecx_sidecar_registered") == 1, 30,
                   "E registered by its sidecar")
        proxy = ecx_proxy(stack, e, pd)
        e.kill()
        wait_until(lambda: sidecar_metric(side, "ecx_sidecar_registered") == 0, 30,
                   "E deregistered by its sidecar once its /health failed")
        # E down: the proxy finds no encoder for the images and leaves them to PD.
        status, body, seconds = ask(proxy.url, down)
        assert seconds < 60, f"with E down, PD took {seconds:.1f} s to encode and answer"
        assert status == 200, body
        assert text_of(body) == reference.text(down)
        assert pd.alive()
        # E again, with the same command: the same host, ports and agent addresses.
        new = e_engine(epd_hosts["model"], epd_hosts["secret"], epd_hosts["logs"], e.port,
                       7100, e.metrics_port, name="e-restarted")
        epd_hosts["e"] = new
        new.start().wait_ready()
        # The proxy finds it by its health checks (every 250 ms), nobody tells it.
        wait_until(lambda: proxy_health(proxy)["encoders_reachable"] == 1, 30,
                   "the proxy sees the restarted E")
        wait_until(lambda: sidecar_metric(side, "ecx_sidecar_registered") == 1, 30,
                   "the restarted E registered again")
        assert sidecar_metric(side, "ecx_sidecar_registrations_total") == 2
        ask_loaded(proxy.url, pd, back, reference, "the restarted E")
    pins_settle(new)


def test_a_pd_killed_mid_load_leaves_no_pin_at_the_encoder(epd_hosts, reference):
    """Runs last: PD does not come back."""
    e, pd = epd_hosts["e"], epd_hosts["pd"]
    requests = [fresh(230 + k, n_images=3) for k in range(3)]
    params = [encode_on(e, images_of(i)) for i in requests]
    assert e_pins(e) >= 9, "E pins each item it handed out"
    def send(index: int, given: dict) -> None:
        try:
            post(pd.url + "/v1/chat/completions", chat_body(index, ec_transfer_params=given),
                 timeout=30)
        except OSError:
            pass  # PD died under it: what is tested is E's side

    sent = [threading.Thread(target=send, args=(i, p), daemon=True)
            for i, p in zip(requests, params)]
    for t in sent:
        t.start()
    time.sleep(0.2)
    pd.kill()
    # Nobody gives those pins back: the lease ends them.
    pins_settle(e, LEASE_MS / 1000 + 30)
    assert e.alive()
    assert json.dumps(encode_on(e, images_of(requests[0])))  # E still answers
    pins_settle(e, LEASE_MS / 1000 + 30)
