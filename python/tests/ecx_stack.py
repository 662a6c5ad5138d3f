"""Starts and stops ecx services for tests.

A service is `ecx serve ROLE --port 0 ...`: it binds a free port and prints
"ecx serve ROLE listening on URL" on stdout once it accepts connections. We wait
for that line (with a deadline, no sleeps), then keep draining stdout into a log
file so the service never blocks on a full pipe.

Every process started here is stopped on every path: `start_service` stops its
process when the service does not come up, and `EcxStack` (a context manager)
stops all the services it started when its block ends, however it ends. Stopping
is SIGTERM, a bounded wait, then SIGKILL. As a last resort for a test run that is
itself killed, each service gets SIGTERM from the kernel when pytest dies
(PR_SET_PDEATHSIG; strictly, when the thread that started it exits, so start
services from the test's own thread).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import signal
import subprocess
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# The connector config the service tests use: pull-mode p2p with a small pool.
DEFAULT_EC_CONFIG = '{"connector":"p2p","extra":{"pool_bytes":"64MiB"}}'

START_TIMEOUT_S = 60.0  # until "listening on" (a cold start of a release build is ~1 s)
STOP_TIMEOUT_S = 10.0  # SIGTERM drains in-flight requests; SIGKILL after this

_PR_SET_PDEATHSIG = 1
_service_numbers = itertools.count(1)  # log file names: encoder-1.out, pd-2.err, ...
_libc = ctypes.CDLL(None, use_errno=True)


def ecx_binary_path() -> Path:
    """The ecx binary under test: $ECX_BINARY if set, else <repo>/build/ecx."""
    return Path(os.environ.get("ECX_BINARY") or REPO_ROOT / "build" / "ecx")


class ServiceStartError(RuntimeError):
    """A service exited, or did not print its URL, before the deadline."""


class Service:
    """One running `ecx serve ROLE` process. REQUIRES: call stop() (EcxStack does)."""

    def __init__(self, role: str, argv: list[str], log_dir: Path):
        self.role = role
        self.argv = argv
        self.url: str | None = None
        name = f"{role}-{next(_service_numbers)}"
        self.stdout_log = log_dir / f"{name}.out"
        self.stderr_log = log_dir / f"{name}.err"
        self.killed = False  # True when it ignored SIGTERM and needed SIGKILL
        self._stdout_closed = False  # set by the reader at EOF
        self._listening = threading.Event()
        self._stderr_file = open(self.stderr_log, "wb")
        parent = os.getpid()
        try:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=self._stderr_file,
                text=True,
                errors="replace",
                preexec_fn=lambda: _die_with_parent(parent),
            )
        except BaseException:
            self._stderr_file.close()
            raise
        self._reader = threading.Thread(target=self._pump_stdout, name=f"{role}-stdout", daemon=True)
        self._reader.start()

    def _pump_stdout(self) -> None:
        """Copies stdout to the log; notes the URL from the first "listening on" line."""
        with self.process.stdout, open(self.stdout_log, "w") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                if self.url is None and " listening on " in line:
                    self.url = line.split()[-1]
                    self._listening.set()
        self._stdout_closed = True
        self._listening.set()  # EOF: the process is exiting (or closed stdout) without a URL

    def wait_until_listening(self, timeout: float = START_TIMEOUT_S) -> str:
        """Returns the service's URL. Raises ServiceStartError, with its stderr, if
        the process exits or the deadline passes first."""
        self._listening.wait(timeout)
        if self.url is None:
            if self._stdout_closed:  # EOF usually means it is exiting: collect the exit code
                try:
                    self.process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass
            code = self.process.poll()
            if code is not None:
                why = f"exited with code {code}"
            elif self._stdout_closed:
                why = "closed stdout"
            else:
                why = f"printed no URL within {timeout:.0f} s"
            raise ServiceStartError(
                f"ecx serve {self.role} {why} before listening; "
                f"command: {' '.join(self.argv)}\n--- stderr ({self.stderr_log}):\n{self.stderr_tail()}"
            )
        return self.url

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to `timeout`, then SIGKILL. Returns the exit code.
        Safe to call more than once."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.killed = True
                self.process.kill()
                self.process.wait()  # SIGKILL cannot be caught: no deadline needed
        # stdout hits EOF once the process is gone, unless a child of it still holds
        # the pipe; the reader is a daemon thread and closes the pipe itself.
        self._reader.join(timeout)
        self._stderr_file.close()
        return self.process.returncode

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stderr_tail(self, max_chars: int = 4000) -> str:
        return self.stderr_log.read_text(errors="replace")[-max_chars:]


def service_argv(binary: Path, role: str, args: list[str], ec_config: str = DEFAULT_EC_CONFIG) -> list[str]:
    """`ecx serve ROLE --port 0 --ec-config EC_CONFIG ARGS...`"""
    return [str(binary), "serve", role, "--port", "0", "--ec-config", ec_config, *args]


def start_service(binary: Path, role: str, args: list[str], log_dir: Path,
                  ec_config: str = DEFAULT_EC_CONFIG, timeout: float = START_TIMEOUT_S) -> Service:
    """Starts one service and waits for its URL. On any failure (including an
    interrupt) the process is stopped before the exception propagates."""
    service = Service(role, service_argv(binary, role, args, ec_config), log_dir)
    try:
        service.wait_until_listening(timeout)
    except BaseException:
        service.stop()
        raise
    return service


class EcxStack:
    """Services started together, stopped together (in reverse order) when the
    `with` block ends, whether it returns or raises.

        with EcxStack(binary, log_dir) as stack:
            stack.start_epd()
            ... stack.proxy.url ...
    """

    def __init__(self, binary: Path, log_dir: Path, ec_config: str = DEFAULT_EC_CONFIG):
        self.binary = binary
        self.log_dir = log_dir
        self.ec_config = ec_config
        self.services: list[Service] = []
        self.encoder: Service | None = None
        self.pd: Service | None = None
        self.proxy: Service | None = None

    def start(self, role: str, *args: str) -> Service:
        """Starts `ecx serve ROLE ... ARGS` and waits for its URL. The service is
        recorded before the wait, so one that fails to start is stopped with the rest."""
        service = Service(role, service_argv(self.binary, role, list(args), self.ec_config), self.log_dir)
        self.services.append(service)
        service.wait_until_listening()
        return service

    def start_epd(self) -> None:
        """One encoder, one pd, and a proxy in front of them."""
        self.encoder = self.start("encoder")
        self.pd = self.start("pd")
        self.proxy = self.start("proxy", "--encoders", self.encoder.url, "--pd", self.pd.url)

    def processes(self) -> list[subprocess.Popen]:
        return [s.process for s in self.services]

    def stop(self) -> None:
        """Stops every service; one that fails to stop does not keep the others running."""
        errors = []
        for service in reversed(self.services):
            try:
                service.stop()
            except BaseException as e:  # noqa: BLE001 - re-raised below after the others stop
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> "EcxStack":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def assert_all_exited(stack: EcxStack) -> None:
    """No process the stack started is still running."""
    running = [f"{s.role} (pid {s.process.pid})" for s in stack.services if s.process.poll() is None]
    assert not running, f"still running after the stack stopped: {', '.join(running)}"


def assert_all_stopped_cleanly(stack: EcxStack) -> None:
    """Every process the stack started has exited, after SIGTERM alone, with code 0."""
    assert_all_exited(stack)
    unclean = [f"{s.role}: exit code {s.process.returncode}{' after SIGKILL' if s.killed else ''}"
               for s in stack.services if s.killed or s.process.returncode != 0]
    assert not unclean, f"services did not stop cleanly on SIGTERM: {'; '.join(unclean)}"


def _die_with_parent(parent_pid: int) -> None:
    """In the child before exec: SIGTERM when the test process dies, even by SIGKILL."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
