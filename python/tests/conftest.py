"""Fixtures shared by the Python tests; the helpers themselves live in ecx_stack.py."""

import pytest

from ecx_stack import ecx_binary_path


@pytest.fixture(scope="session")
def ecx_binary():
    """The ecx binary under test ($ECX_BINARY, else <repo>/build/ecx). A missing
    binary fails the tests that need it (it is never a reason to skip them)."""
    path = ecx_binary_path()
    if not (path.is_file() and path.stat().st_mode & 0o111):
        pytest.fail(f"ecx binary not found at {path}: build it with `scripts/build release` "
                    "or point ECX_BINARY at one", pytrace=False)
    return path
