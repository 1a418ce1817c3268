"""`torchrun --nproc-per-node 2 -m dsv41 …` on loopback against one process, and a rank that dies.

Each torchrun run writes every rank's stdout and stderr to its own file (`--redirects 3`), so the tests
see that only rank 0 printed. Expectations on the demo model: the default layout (TP 2 × EP 2) in fast
float32 numerics gives the same greedy tokens as one process (its split reductions move logits only in
the last bits); expert parallelism alone in reference numerics is bit-identical, so its scores print
the same. The failure tests start the two ranks themselves with the variables torchrun would set, stop
one with a signal once a chat turn has run, and time how long the other takes to exit.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from dsv41 import cli

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 120
RANK_TIMEOUT_S = 6
EXIT_BOUND_S = 30
# Fast float32 numerics: TP 2 agrees with one process within rounding, so greedy tokens are the same.
FAST = ("--numerics", "fast", "--dtype", "float32")
GREEDY = ("--raw", "The quick brown fox", "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(cli_env):
    """The session's demo (built before any rank starts) and one intra-op thread per process."""
    return cli_env


def single(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv41", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)


def torchrun(env, tmp_path, *args, ok: bool = True) -> tuple[int, list[str], list[str]]:
    """→ (torchrun's exit status, each rank's stdout, each rank's stderr); `ok`: it must succeed."""
    logs = tmp_path / "logs"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--log-dir", str(logs),
                          "--redirects", "3", "-m", "dsv41", *args], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    read = lambda rank, name: "".join(p.read_text() for p in logs.glob(f"*/attempt_0/{rank}/{name}.log"))
    outs, errs = [read(r, "stdout") for r in range(2)], [read(r, "stderr") for r in range(2)]
    assert run.returncode == 0 or not ok, f"{run.stderr}\nrank 0: {errs[0]}\nrank 1: {errs[1]}"
    return run.returncode, outs, errs


def stats_lines(stderr: str) -> list[str]:
    """The per-request stats lines without their timings."""
    return [line.split(", TTFT")[0] + line.split("tok/s")[1] for line in stderr.splitlines()
            if line.startswith("prompt ")]


# ------------------------------------------------------------------------------------ same as one process
def test_generate_under_torchrun_prints_what_one_process_prints(env, tmp_path):
    alone = single(env, "generate", *GREEDY, *FAST)
    assert alone.returncode == 0, alone.stderr
    _, outs, errs = torchrun(env, tmp_path, "generate", *GREEDY, *FAST)
    assert outs[0] == alone.stdout and outs[0].strip()
    assert stats_lines(errs[0]) == stats_lines(alone.stderr)
    assert outs[1] == "" and errs[1] == ""                     # the follower prints nothing


def test_speculative_generate_under_torchrun(env, tmp_path):
    alone = single(env, "generate", *GREEDY, *FAST, "--speculative")
    assert alone.returncode == 0, alone.stderr
    _, outs, errs = torchrun(env, tmp_path, "generate", *GREEDY, *FAST, "--speculative")
    assert outs[0] == alone.stdout
    [line] = stats_lines(errs[0])
    assert "drafts" in line and [line] == stats_lines(alone.stderr)     # the same drafts, accepted alike
    assert outs[1] == "" and errs[1] == ""


def test_score_with_expert_parallelism_is_bit_identical(env, tmp_path):
    texts = ("The quick brown fox", "Hi!")
    alone = single(env, "score", *texts)
    assert alone.returncode == 0, alone.stderr
    _, outs, errs = torchrun(env, tmp_path, "score", *texts, "--tp", "1", "--ep", "2")
    assert outs[0] == alone.stdout and "perplexity" in outs[0]
    assert outs[1] == "" and errs[1] == ""


def test_two_nodes_meet_through_the_c10d_rendezvous(env, tmp_path):
    """Two torchrun agents (--nnodes 2, one rank each) as two machines would start them; node 0's rank
    prints the one-process output."""
    alone = single(env, "generate", *GREEDY, *FAST)
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                               "--rdzv-id", "dsv41-test", "-m", "dsv41", "generate", *GREEDY, *FAST],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                              stdin=subprocess.DEVNULL) for n in range(2)]
    try:
        results = [node.communicate(timeout=RUN_TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], results
    printed = [out for out, _ in results]
    assert alone.stdout in printed and printed.count("") == 1     # one rank printed, the other nothing


def _serve_one_request(env, launcher: list[str], body: dict, stop: signal.Signals) -> tuple[dict, int]:
    """Start `dsv41 serve` with `launcher`, send one chat completion, stop it with `stop`; → (the reply,
    the launcher's exit status)."""
    import httpx2

    port = _free_port()
    server = subprocess.Popen([*launcher, "-m", "dsv41", "serve", "--port", str(port), "--max-context", "512", *FAST],
                              env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx2.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.2)
        name = httpx2.get(url + "/v1/models").json()["data"][0]["id"]
        reply = httpx2.post(url + "/v1/chat/completions", json=dict(body, model=name), timeout=60).json()
        server.send_signal(stop)
        status = server.wait(RUN_TIMEOUT_S)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return reply, status


def test_serve_under_torchrun_answers_like_one_process_and_stops_cleanly(env, tmp_path):
    """Rank 0 serves: a greedy chat completion equals one process's (Ctrl-C ends that one, exit 0).
    SIGTERM to torchrun: the agent passes it on and reports it (its own exit status says so), rank 0
    drains and stops the follower, and both ranks exit 0 without a traceback, the follower silent."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0, "thinking": {"type": "disabled"}}
    logs = tmp_path / "logs"
    alone, status = _serve_one_request(env, [sys.executable], body, signal.SIGINT)
    assert status == 0
    parallel, _ = _serve_one_request(env, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                                        "--log-dir", str(logs), "--redirects", "3"], body, signal.SIGTERM)
    assert "choices" in parallel, parallel
    assert parallel["choices"][0]["message"] == alone["choices"][0]["message"]
    assert parallel["usage"] == alone["usage"] and parallel["usage"]["completion_tokens"] > 0
    assert "".join(p.read_text() for p in logs.glob("*/attempt_0/1/std*.log")) == ""
    rank0 = "".join(p.read_text() for p in logs.glob("*/attempt_0/0/stderr.log"))
    assert "Application shutdown complete" in rank0 and "Traceback" not in rank0


def test_a_failed_load_is_reported_by_each_rank_as_itself(env, tmp_path):
    status, outs, errs = torchrun(env, tmp_path, "generate", "hi", "--max-context", "999999", ok=False)
    assert status != 0
    [message] = error_lines(errs[0])
    assert "999,999 positions" in message                      # the real error, not a lost follower
    assert error_lines(errs[1]) == [message.replace("error: ", "error: rank 1: ", 1)]
    assert outs == ["", ""]


# ------------------------------------------------------------------------------------ a rank that dies
def start_ranks(env) -> list[subprocess.Popen]:
    """Two ranks of `dsv41 chat`, started with the variables torchrun would set; rank 0 has run one turn
    when this returns (its stdin stays open, so it then waits for the next line)."""
    port = str(_free_port())
    ranks = []
    for rank in range(2):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(subprocess.Popen(
            [sys.executable, "-m", "dsv41", "chat", "--max-new-tokens", "2", "--temperature", "0",
             "--numerics", "fast", "--rank-timeout", str(RANK_TIMEOUT_S)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=rank_env, cwd=REPO,
            text=True))
    ranks[0].stdin.write("hi\n")
    ranks[0].stdin.flush()
    assert ranks[0].stdout.readline(), ranks[0].stderr.read()
    return ranks


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dsv41: error:")]


@pytest.mark.parametrize("victim, how, expected", [
    (1, signal.SIGKILL, "rank 0: rank 1 closed its connection"),
    (0, signal.SIGKILL, "rank 1: rank 0 closed its connection"),
    (0, signal.SIGSTOP, f"rank 1: rank 0 stopped sending commands for {RANK_TIMEOUT_S} s"),
], ids=["follower-killed", "driver-killed", "driver-stuck"])
def test_the_survivor_reports_the_lost_rank_and_exits(env, victim, how, expected):
    ranks = start_ranks(env)
    try:
        survivor = ranks[1 - victim]
        started = time.monotonic()
        ranks[victim].send_signal(how)
        status = survivor.wait(timeout=EXIT_BOUND_S * 2)
        took = time.monotonic() - started
        _, err = survivor.communicate(timeout=10)
        assert status == cli.EXIT_USAGE, err
        [line] = error_lines(err)
        assert line.startswith(f"dsv41: error: {expected}"), err
        assert took < EXIT_BOUND_S
        if how == signal.SIGSTOP:
            assert took >= RANK_TIMEOUT_S - 1               # the follower waited out the timeout first
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
            for stream in (rank.stdin, rank.stdout, rank.stderr):
                stream.close()


# ------------------------------------------------------------------------------------ one process
def test_parallel_sizes_need_a_parallel_launch(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["generate", "hi", "--tp", "2"]) == cli.EXIT_USAGE
    assert "--tp 2 needs a parallel launch" in capsys.readouterr().err


def test_rank_timeout_must_be_positive(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["generate", "hi", "--rank-timeout", "0"])
    assert stop.value.code == cli.EXIT_USAGE
    assert "--rank-timeout" in capsys.readouterr().err
