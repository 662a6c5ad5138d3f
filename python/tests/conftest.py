"""Fixtures shared by the Python tests; the helpers themselves live in ecx_stack.py and
vllm_engines.py."""

import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from ecx_stack import ecx_binary_path

# The benchmark harness and model builder (bench/python/, not part of the ecx wheel).
BENCH_PY = Path(__file__).resolve().parents[2] / "bench" / "python"


@pytest.fixture(scope="session")
def ecx_binary():
    """The ecx binary under test ($ECX_BINARY, else <repo>/build/ecx). A missing
    binary fails the tests that need it (it is never a reason to skip them)."""
    path = ecx_binary_path()
    if not (path.is_file() and path.stat().st_mode & 0o111):
        pytest.fail(f"ecx binary not found at {path}: build it with `scripts/build release` "
                    "or point ECX_BINARY at one", pytrace=False)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny Qwen2-VL, built offline (python bench/python/tiny_vlm.py)."""
    out = tmp_path_factory.mktemp("tiny-vlm")
    subprocess.run([sys.executable, str(BENCH_PY / "tiny_vlm.py"), str(out), "--geometry", "tiny"],
                   check=True, timeout=600)
    return out


@pytest.fixture(scope="session")
def deployment_secret(tmp_path_factory):
    """A deployment secret in a file only its owner reads (auth_token_file)."""
    path = tmp_path_factory.mktemp("secret") / "token"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="session")
def reference(tiny_model, tmp_path_factory):
    """A single vLLM instance of the tiny model (started now, waited for on first use)."""
    from vllm_reference import Reference
    ref = Reference(tiny_model, tmp_path_factory.mktemp("reference"))
    ref.engine.start()
    yield ref
    ref.engine.stop()
