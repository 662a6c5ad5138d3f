"""The test helpers stop every service they start, on every path (the shell test they
replace leaked its services)."""

import pytest

from ecx_stack import EcxStack, ServiceStartError, assert_all_exited


def test_stack_stops_its_services_when_the_block_raises(ecx_binary, tmp_path):
    with pytest.raises(RuntimeError, match="test body failed"):
        with EcxStack(ecx_binary, tmp_path) as stack:
            stack.start("encoder")
            stack.start("pd")
            raise RuntimeError("test body failed")
    assert [s.role for s in stack.services] == ["encoder", "pd"]
    # Only "gone", not "exited cleanly": SIGTERM this soon after "listening on" can
    # land before the HTTP listener runs, and the service then needs SIGKILL.
    assert_all_exited(stack)


def test_a_service_that_does_not_start_is_reported_and_the_others_stopped(ecx_binary, tmp_path):
    with pytest.raises(ServiceStartError, match="ecx serve no-such-role exited with code") as error:
        with EcxStack(ecx_binary, tmp_path) as stack:
            stack.start("encoder")
            stack.start("no-such-role")
    assert [s.role for s in stack.services] == ["encoder", "no-such-role"]
    stderr = stack.services[1].stderr_tail().strip()
    assert stderr and stderr in str(error.value), "the error carries the service's stderr"
    assert_all_exited(stack)
