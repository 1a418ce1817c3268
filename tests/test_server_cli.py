"""`dsv41 serve` as a user runs it: a subprocess on the demo model, loopback by default; Ctrl-C drains
(a running stream finishes, then the process exits 0); a bad checkpoint is one error line, exit 2."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_and_drains_a_running_stream_on_ctrl_c(demo_dir):
    port = free_port()
    env = dict(os.environ, DSV41_CACHE=str(demo_dir.parent), DSV41_DEMO="random")
    proc = subprocess.Popen([sys.executable, "-m", "dsv41", "serve", "--checkpoint", str(demo_dir), "--port",
                             str(port), "--max-context", "512", "--numerics", "fast", "--speculative"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx2.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            time.sleep(0.1)
        assert httpx2.get(url + "/v1/models").json()["data"][0]["id"] == demo_dir.name
        body = {"model": demo_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                "stream": True, "thinking": {"type": "disabled"},
                "ignore_eos": True}                                   # the random model may sample EOS early
        with httpx2.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
            proc.send_signal(signal.SIGINT)                     # mid-stream
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert f"http://127.0.0.1:{port}" in err and "Traceback" not in err


def test_serve_with_a_missing_checkpoint_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dsv41", "serve", "--checkpoint", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"dsv41: error: checkpoint directory not found: {tmp_path / 'none'}"]
