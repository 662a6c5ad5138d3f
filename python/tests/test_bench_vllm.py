"""`ecx bench vllm`'s pure-Python parts (bench/python/bench_vllm*.py), without vLLM engines:
the EC load join, the timed connector subclass, the error a failed engine start reports,
and the correctness scoring. (The engines themselves run in `ecx bench vllm --quick`.)"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ECX_DIR = Path(__file__).resolve().parents[2] / "bench" / "python"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_test_{name}", ECX_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


timing = _load("bench_vllm_timing")
rt = _load("bench_vllm_runtime")
bench = _load("bench_vllm")


def sight(t, req, items, consumer=True):
    return {"ev": "sight", "t": t, "req": req, "items": items, "hook": "ensure_cache_available",
            "consumer": consumer}


def filled(t, items):
    return {"ev": "filled", "t": t, "items": items}


def test_load_time_is_first_sight_to_last_item_filled_divided_by_items():
    events = [sight(10.0, "a", ["x", "y"]), filled(10.010, ["x"]), filled(10.030, ["y"]),
              sight(11.0, "b", ["z"]), filled(11.004, ["z"])]
    stats = timing.ec_load_stats(events)
    assert stats["requests"] == 2 and stats["items"] == 3 and stats["not_loaded"] == 0
    # a: 30 ms / 2 items = 15 ms; b: 4 ms / 1 item
    assert stats["from_sight"]["mean"] == pytest.approx((15.0 + 4.0) / 2)
    assert stats["from_sight"]["p50"] == pytest.approx(9.5)
    assert stats["from_alloc"] is None  # no alloc events


def test_items_never_filled_after_the_sight_are_not_timed():
    events = [filled(9.0, ["x"]),  # before the request: another request's load
              sight(10.0, "a", ["x"]),
              sight(10.5, "b", ["y"]), filled(10.6, ["y"])]
    stats = timing.ec_load_stats(events)
    assert stats["requests"] == 1 and stats["not_loaded"] == 1
    assert stats["from_sight"]["p50"] == pytest.approx(100.0)


def test_window_and_producer_sights_are_left_out():
    events = [sight(5.0, "early", ["w"]), filled(5.1, ["w"]),
              sight(10.0, "e-side", ["x"], consumer=False),
              sight(10.2, "a", ["x"]), filled(10.3, ["x"])]
    stats = timing.ec_load_stats(events, t_from=9.0, t_to=20.0)
    assert stats["requests"] == 1
    assert stats["from_sight"]["mean"] == pytest.approx(100.0)
    assert timing.ec_load_stats([], 0, 1)["from_sight"] is None


def test_from_alloc_is_per_item_from_its_scheduling_step_to_its_fill():
    events = [sight(10.0, "a", ["x", "y"]),
              {"ev": "alloc", "t": 12.0, "req": "a", "item": "x"}, filled(12.002, ["x"]),
              {"ev": "alloc", "t": 15.0, "req": "a", "item": "y"}, filled(15.006, ["y"])]
    stats = timing.ec_load_stats(events)
    assert stats["from_sight"]["mean"] == pytest.approx(5006.0 / 2)  # queued for steps
    assert stats["from_alloc"]["mean"] == pytest.approx(4.0)
    assert stats["from_alloc"]["p99"] == pytest.approx(5.96)


class FakeBase:
    """Stands in for a connector class: records the calls that reach it."""

    def __init__(self, vllm_config, role):
        self.is_consumer = True
        self.calls = []

    def ensure_cache_available(self, request, n):
        self.calls.append("ensure")
        return False

    def update_state_after_alloc(self, request, index):
        self.calls.append("alloc")

    def has_cache_item(self, identifier):
        return identifier == "x"

    def start_load_caches(self, encoder_cache, **kwargs):
        encoder_cache["x"] = "tensor"


class Feature:
    def __init__(self, identifier):
        self.identifier = identifier


class Request:
    request_id = "r1"
    mm_features = [Feature("x")]


def test_the_workers_call_is_timed_per_item_it_filled():
    events = [sight(1.0, "a", ["x", "y"]),
              {"ev": "filled", "t": 1.5, "items": ["x", "y"], "call_ms": 8.0},
              {"ev": "filled", "t": 2.5, "items": ["z"], "call_ms": 3.0}]
    assert timing.ec_load_stats(events)["worker_call"]["mean"] == pytest.approx(3.5)


def test_engine_steps_are_the_forward_pass_plus_the_connectors_time_in_schedule():
    events = [{"ev": "step", "t": 1.0, "tokens": 100, "ensure_ms": 20.0},
              {"ev": "stepped", "t": 1.5},
              {"ev": "step", "t": 1.6, "tokens": 0, "ensure_ms": 0.0},  # nothing scheduled
              {"ev": "stepped", "t": 1.61},
              # idle: no schedule() until a request comes; the gap is never a step
              {"ev": "step", "t": 9.0, "tokens": 8, "ensure_ms": 0.0},
              {"ev": "stepped", "t": 9.3},
              {"ev": "step", "t": 9.4, "tokens": 8, "consumer": False},
              {"ev": "stepped", "t": 9.9, "consumer": False}]
    stats = timing.step_stats(events)
    assert stats["steps"] == 2  # 520 ms (500 + 20 in ensure) and 300 ms
    assert stats["mean"] == pytest.approx(410.0)
    assert stats["ensure_mean"] == pytest.approx(10.0)
    assert stats["empty_steps"] == 1  # the consumer's step at 1.6 scheduled nothing
    assert timing.step_stats(events, t_from=9.5) is None


def test_dispatch_phases_split_first_sight_to_fill_at_vllms_own_marks():
    sched, worker, e_worker = 100, 200, 300

    def at(ev, t, pid, **kw):
        return {"ev": ev, "t": t, "pid": pid, **kw}

    events = [
        # PD's request a: look 1 ms (0.6 of it in ensure), build 0.2, 0.1 to the executor,
        # 2 ms through vLLM's queue, 3 ms in _update_states/_prepare_inputs, 0.1, call 0.5
        {**sight(10.0, "a", ["x"]), "pid": sched},
        at("step", 10.001, sched, tokens=8, ensure_ms=0.6, consumer=True),
        at("built", 10.0012, sched, ms=0.2, consumer=True),
        at("sent", 10.0013, sched),
        at("run", 10.0020, e_worker),  # E's worker: another engine, not PD's
        at("run", 10.0033, worker), at("pre", 10.0063, worker),
        {**filled(10.0069, ["x"]), "pid": worker, "call_ms": 0.5},
        # b: 0.1 ms in ensure, 1 ms through the queue
        {**sight(11.0, "b", ["y"]), "pid": sched},
        at("step", 11.001, sched, tokens=8, ensure_ms=0.1, consumer=True),
        at("built", 11.0012, sched, ms=0.2, consumer=True),
        at("sent", 11.0013, sched),
        at("run", 11.0023, worker), at("pre", 11.0053, worker),
        {**filled(11.0059, ["y"]), "pid": worker, "call_ms": 0.5},
        # E's scheduler: a producer's sight is never a load
        {**sight(11.5, "e", ["w"], consumer=False), "pid": 400},
        # c: not scheduled in the step of its first sight (its load not done), but in the
        # next one, 100 ms later: that step's marks split it, the wait is in its look
        {**sight(12.0, "c", ["z"]), "pid": sched},
        at("step", 12.001, sched, tokens=8, ensure_ms=1.0, consumer=True),
        at("built", 12.0012, sched, ms=0.2, consumer=True),
        at("sent", 12.0013, sched), at("run", 12.0023, worker), at("pre", 12.0053, worker),
        at("step", 12.101, sched, tokens=8, ensure_ms=0.1, consumer=True),
        at("built", 12.1012, sched, ms=0.2, consumer=True),
        at("sent", 12.1013, sched), at("run", 12.1023, worker), at("pre", 12.1053, worker),
        {**filled(12.1059, ["z"]), "pid": worker, "call_ms": 0.5}]
    later = timing.dispatch_phases(events, t_from=11.9)
    assert later["requests"] == 1
    assert later["look"]["mean"] == pytest.approx(101.0, abs=1e-3)
    assert later["run_pre"]["mean"] == pytest.approx(3.0, abs=1e-3)
    assert later["sent_run_by_ensure"]["under"]["mean"] == pytest.approx(1.0, abs=1e-3)
    phases = timing.dispatch_phases(events, t_to=11.9)
    assert phases["requests"] == 2
    expected = {"look": 1.0, "build": 0.2, "to_sent": 0.1, "sent_run": 1.5, "run_pre": 3.0,
                "pre_call": 0.1, "call": 0.5}
    for name, ms in expected.items():
        assert phases[name]["mean"] == pytest.approx(ms, abs=1e-3), name
    assert phases["sent_run_by_ensure"]["over"]["mean"] == pytest.approx(2.0, abs=1e-3)
    assert phases["sent_run_by_ensure"]["under"]["mean"] == pytest.approx(1.0, abs=1e-3)
    assert timing.dispatch_phases(events, t_from=10.5, t_to=11.9)["requests"] == 1
    # Without the diagnostic's events there is nothing to split.
    assert timing.dispatch_phases([e for e in events if e["ev"] != "sent"]) is None


def test_timed_subclass_calls_the_real_methods_and_records_events(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    monkeypatch.setenv(timing.ENV, str(path))
    cls = timing.timed(FakeBase)
    assert cls.__name__ == "TimedFakeBase" and issubclass(cls, FakeBase)
    c = cls(None, None)
    assert c.ensure_cache_available(Request(), 0) is False
    c.update_state_after_alloc(Request(), 0)
    assert c.has_cache_item("x") is True
    cache = {"old": 1}
    c.start_load_caches(cache)
    assert c.calls == ["ensure", "alloc"] and cache["x"] == "tensor"
    events = timing.read_events(str(path))
    assert [e["ev"] for e in events] == ["sight", "alloc", "filled"]  # one sight per request
    assert events[0]["items"] == ["x"] and events[2]["items"] == ["x"]
    stats = timing.ec_load_stats(events)
    assert stats["requests"] == 1 and stats["from_alloc"] is not None


@pytest.mark.parametrize("cores, pd, e", [
    ({0, 1}, "0", "1"), ({0, 1, 2, 3}, "0,1", "2,3"), ({1, 3, 4}, "1", "3,4")])
def test_e_and_pd_workers_get_cores_of_their_own(monkeypatch, cores, pd, e):
    # Both left to vLLM's "auto" would bind both workers to the same first core.
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda _pid: cores)
    assert bench.worker_cores("ec_consumer") == pd
    assert bench.worker_cores("ec_producer") == e
    env = bench.row_env("ecx", "ec_producer", {"place": bench.ONE_MACHINE, "timed": False,
                                              "item_digests": False})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == e


def test_one_core_is_left_to_vllms_binding(monkeypatch):
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda _pid: {0})
    assert bench.worker_cores("ec_consumer") is None
    env = bench.row_env("ecx", "ec_consumer", {"place": bench.ONE_MACHINE, "timed": False,
                                              "item_digests": False})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env


def test_the_stack_sampler_writes_the_main_threads_stack_when_asked(tmp_path, monkeypatch):
    import os
    import time
    monkeypatch.setattr(timing, "_sampling", False)
    monkeypatch.setattr(timing, "STACKS_MAX_S", 3)  # then it stops by itself
    monkeypatch.delenv(timing.STACKS_ENV, raising=False)
    timing._start_stack_sampler()
    assert not timing._sampling  # off unless asked
    monkeypatch.setenv(timing.STACKS_ENV, str(tmp_path / "stacks"))
    timing._start_stack_sampler()
    timing._start_stack_sampler()  # one sampler per process
    out = tmp_path / f"stacks.{os.getpid()}"
    deadline = time.monotonic() + 10
    lines = []
    while time.monotonic() < deadline and not any(
            "test_the_stack_sampler" in "".join(json.loads(x)["s"]) for x in lines):
        time.sleep(0.02)
        lines = out.read_text().splitlines() if out.exists() else []
    samples = [json.loads(x) for x in lines]
    assert any(any("test_the_stack_sampler_writes" in f for f in s["s"]) for s in samples)
    assert all(isinstance(s["t"], float) for s in samples)
    threads = [t.name for t in __import__("threading").enumerate()]
    assert threads.count("ecx-bench-stacks") == 1


def test_module_getattr_names_only_known_connectors():
    with pytest.raises(AttributeError):
        timing.TimedNoSuchConnector  # noqa: B018


def test_root_error_skips_wrappers_and_keeps_pydantics_message():
    log = "\n".join([
        "(EngineCore pid=12) ERROR 12-02 17:22:51 [core.py:1] EngineCore failed to start.",
        "(EngineCore pid=12) Traceback (most recent call last):",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig",
        "  Value error, Model Runner V2 requires Triton. [type=value_error, input_value=...]",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core",
    ])
    assert rt.root_error(log) == ("pydantic_core._pydantic_core.ValidationError: 1 validation "
                                  "error for VllmConfig Value error, Model Runner V2 requires "
                                  "Triton.")
    log2 = ("(Worker pid=6424) ERROR 12-02 17:22:51 [multiproc_executor.py:953] "
            "ModuleNotFoundError: No module named 'ecx.vllm'\n"
            "RuntimeError: Engine core initialization failed. See root cause above.")
    assert rt.root_error(log2) == "ModuleNotFoundError: No module named 'ecx.vllm'"


def test_score_compares_with_the_single_instance():
    rows = [rt.empty_row("single", "single"), rt.empty_row("ECXConnector", "ecx"),
            rt.empty_row("ECCPUConnector", "cpu")]
    rows[0].update(texts=["a", "b", "c"], bench_texts=["p", "q"])
    rows[1].update(texts=["a", "x", None], bench_texts=["p", "q"])
    rows[2]["error"] = "E exited"
    rt.score(rows, {})
    assert (rows[0]["correct"], rows[0]["total"]) == (3, 3)
    assert (rows[1]["correct"], rows[1]["total"], rows[1]["bench_texts_equal"]) == (1, 3, 2)
    assert rows[2]["correct"] is None and "texts" not in rows[1]


def test_fixed_requests_are_deterministic_greedy_and_sized():
    pytest.importorskip("PIL")
    w = {"correctness_prompts": 4, "max_images": 3, "image_side": 28, "output_len": 5}
    a, b = rt.fixed_requests(w), rt.fixed_requests(w)
    assert json.dumps(a) == json.dumps(b)
    assert [sum(1 for p in r["messages"][0]["content"] if p["type"] == "image_url")
            for r in a] == [1, 2, 3, 1]
    assert all(r["temperature"] == 0 and r["max_tokens"] == 5 for r in a)
    # The video workload: the same requests with a video for each image.
    videos = rt.fixed_requests({**w, "frames": 4, "max_images": 1})
    assert json.dumps(videos) == json.dumps(rt.fixed_requests({**w, "frames": 4,
                                                               "max_images": 1}))
    assert [[p["type"] for p in r["messages"][0]["content"]] for r in videos] == \
        [["video_url", "text"]] * 4
    assert videos[0]["messages"][0]["content"][0]["video_url"]["url"].startswith(
        "data:video/mp4;base64,")
    assert rt.mm_limits({**w, "frames": 4}) == {"image": 0, "video": 3}


def test_item_digests_compare_what_e_computed_with_what_pd_cached():
    events = [
        {"ev": "saved", "item": "a", "digest": "1", "consumer": False},
        {"ev": "saved", "item": "b", "digest": "2", "consumer": False},
        {"ev": "filled", "t": 1.0, "items": ["a", "b"], "digests": {"a": "1", "b": "x"}},
        {"ev": "filled", "t": 2.0, "items": ["c"], "digests": {"c": "3"}},
    ]
    assert timing.item_digests(events) == {"items": 3, "equal": 1, "differ": ["b"],
                                           "not_saved": 1}
    assert timing.item_digests([{"ev": "filled", "t": 1.0, "items": ["a"]}]) is None


def test_across_hosts_the_limit_is_the_items_bytes_at_the_rate_plus_one_rtt(tmp_path):
    bench = _load("bench_vllm")
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 2048}}))
    w = dict(bench.WORKLOADS["full"])
    # The seed geometry's item: 400 tokens x 2048 bf16 = 1600 KiB.
    assert bench.item_bytes(tmp_path, w) == 1600 << 10
    assert bench.item_bytes(tmp_path, dict(bench.WORKLOADS["video"])) == 8 * 1600 << 10
    limit = bench.physical_limit(tmp_path, w, 1.0, "10gbit")
    assert limit["limit_ms"] == pytest.approx((1600 << 10) * 8 / 10e9 * 1e3 + 1.0)
    assert bench.rate_bits("800mbit") == 800e6 and bench.rate_bits("1.5Gbit") == 1.5e9
    with pytest.raises(ValueError, match="10gbit"):
        bench.rate_bits("10 GB/s")
    rows = [{"connector": "ECXConnector", "ec_load_ms_per_item": {"p50": limit["limit_ms"],
                                                                  "mean": 2 * limit["limit_ms"]}},
            {"connector": "single", "ec_load_ms_per_item": None}]
    bench.against_limit(rows, limit)
    assert rows[0]["ec_load_vs_limit"] == pytest.approx({"p50": 1.0, "mean": 2.0})
    assert "ec_load_vs_limit" not in rows[1]
