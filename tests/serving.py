"""A real dsv41 server on loopback for the server tests: uvicorn on a free port in a background thread,
the app and engine exactly as `dsv41 serve` builds them (only the model is loaded once and shared)."""

from __future__ import annotations

import socket
import threading
import time

import httpx2
import uvicorn

from dsv41.server.app import ServerConfig, ServerState, create_app


class LiveServer:
    def __init__(self, load, config: ServerConfig):
        self.state = ServerState(config, load)
        self.app = create_app(self.state)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self, wait_ready: bool = True, timeout_s: float = 120.0) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                status = httpx2.get(self.url + "/health", timeout=2).status_code
                if status == 200 or (not wait_ready and status == 503):
                    return self
            except httpx2.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"the test server did not become ready: {self.state.load_error}")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    @property
    def engine(self):
        return self.state.service.engine

    def wait_idle(self, timeout_s: float = 20.0) -> bool:
        """Until no request runs or waits in the engine (→ True), or the timeout (→ False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.engine.running and not self.engine.queue_depth and not self.state.service.open_requests:
                return True
            time.sleep(0.05)
        return False

    def __enter__(self) -> "LiveServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
