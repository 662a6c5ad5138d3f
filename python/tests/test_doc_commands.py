"""The commands the user-facing pages show, checked as written, so that a page that drifts
from the code fails scripts/test:

- every `build/ecx ...` line in a fenced block of README.md, QUICKSTART, VLLM.md,
  SERVING.md and INSTALL.md is parsed and checked by ecx itself (ECX_CHECK_ARGS=1: the
  real command-line parser, its flags, values, ranges and environment, nothing run);
- every `--ec-transfer-config '...'` of a `vllm serve` line is the JSON vLLM gets, and
  ECXConnector starts with it (made by vLLM's own factory, as `vllm serve` makes it;
  the page's /etc/ecx/token becomes a test secret of the same mode).

The pages' whole flows run elsewhere: E, PD and both proxies inside real `vllm serve`
engines (test_vllm_engine.py, whose proxy runs without --model as QUICKSTART's does),
and the three services of SERVING.md with the official openai client
(test_openai_client.py)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/QUICKSTART.md", "docs/VLLM.md", "docs/SERVING.md",
         "docs/INSTALL.md"]
_ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def fenced_commands(page: str) -> list[tuple[int, str]]:
    """(line number, command) of every command line in the page's fenced blocks: a line
    ending in a backslash, or inside an open quote, joined with the next."""
    out, block, start, pending = [], False, 0, ""
    for number, line in enumerate((REPO / page).read_text().splitlines(), 1):
        if line.startswith("```"):
            block, pending = not block, ""
            continue
        if not block:
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        pending += line
        if _open_quote(pending):
            pending += " "
            continue
        out.append((start, pending.strip()))
        pending = ""
    return out


def _open_quote(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
        return False
    except ValueError:
        return True


def words_of(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:  # not a shell line (a code sample, a table)
        return []


def ecx_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for number, command in fenced_commands(page):
            words = words_of(command)
            while words and _ENV_ASSIGNMENT.match(words[0]):
                words = words[1:]
            if words and words[0] == "build/ecx":
                found.append((f"{page}:{number}", words))
    return found


def vllm_configs() -> list[tuple[str, dict]]:
    found = []
    for page in PAGES:
        for number, command in fenced_commands(page):
            words = words_of(command)
            if "vllm" not in " ".join(words[:1]) or "--ec-transfer-config" not in words:
                continue
            found.append((f"{page}:{number}",
                          json.loads(words[words.index("--ec-transfer-config") + 1])))
    return found


def test_the_pages_show_commands_of_both_kinds():
    """A change to how pages write their commands must not leave this file checking
    nothing."""
    assert len(ecx_commands()) >= 8, ecx_commands()
    assert len(vllm_configs()) >= 4, vllm_configs()


@pytest.mark.parametrize("where,words", ecx_commands(), ids=[w for w, _ in ecx_commands()])
def test_each_ecx_command_of_the_pages_parses(where, words, ecx_binary, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ECX_")}
    env["ECX_CHECK_ARGS"] = "1"
    # A file the page's command names (a secret, a config) as the page's previous lines
    # made it.
    for i, word in enumerate(words[:-1]):
        if word in ("--auth-token-file", "--config", "--ec-config") and \
                not words[i + 1].startswith("{"):
            target = tmp_path / Path(words[i + 1]).name
            target.write_text("a-deployment-secret-of-enough-length\n")
            target.chmod(0o600)
            words = words[:i + 1] + [str(target)] + words[i + 2:]
    result = subprocess.run([str(ecx_binary)] + words[1:], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (
        f"{where}: `{shlex.join(words)}` is refused by ecx:\n{result.stdout}{result.stderr}")


@pytest.mark.parametrize("where,config", vllm_configs(), ids=[w for w, _ in vllm_configs()])
def test_each_vllm_config_of_the_pages_starts_ecxconnector(where, config, tmp_path,
                                                           monkeypatch):
    from vllm_support import connector
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    assert config["ec_connector"] == "ECXConnector", where
    assert config["ec_connector_module_path"] == "ecx.vllm", where
    extra = dict(config.get("ec_connector_extra_config", {}))
    if "auth_token_file" in extra:  # the page's /etc/ecx/token, made as the page says
        token = tmp_path / "token"
        token.write_text("a-deployment-secret-of-enough-length\n")
        token.chmod(0o600)
        extra["auth_token_file"] = str(token)
    extra["rendezvous_dir"] = str(tmp_path)
    extra["engine_id"] = f"doc-{os.getpid()}-{abs(hash(where)) % 10000}"
    for key in ("ECX_AUTH_TOKEN", "ECX_AUTH_TOKEN_FILE", "ECX_LOG_LEVEL"):
        monkeypatch.delenv(key, raising=False)
    made = connector(config["ec_role"], extra, ECConnectorRole.SCHEDULER)
    made.shutdown()
