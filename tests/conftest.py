"""Test-session setup and shared fixtures (config factories live in `helpers.py`).

The tiny-model tests run thousands of small kernels. With torch's default intra-op threads on a small,
shared CPU machine, thread hand-off dominates: one decode step of the tiny model measured 0.05 s with
one thread and ~0.3 s with two while another process was busy. One thread is the default here;
DSV41_TEST_THREADS overrides it.
"""

from __future__ import annotations

import os

import pytest
import torch

import helpers


def pytest_configure(config):
    torch.set_num_threads(int(os.environ.get("DSV41_TEST_THREADS", "1")))


@pytest.fixture
def two_threads():
    """Two intra-op threads for one test (the native kernels' threaded paths), then the session's."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def nonbinding_cfg():
    return helpers.nonbinding_config()


@pytest.fixture(scope="session")
def binding_cfg():
    return helpers.binding_config()


@pytest.fixture(scope="session")
def released_cfg():
    from dsv41.config import ModelConfig
    return ModelConfig.from_json(helpers.RELEASED_CONFIG)


@pytest.fixture(scope="session")
def released_inv(released_cfg):
    """The released checkpoint layout (docs/CHECKPOINT.md §3), built once per session."""
    from dsv41.checkpoint import released_inventory
    return released_inventory(released_cfg)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The built-in demo checkpoint, created once per test session in a private DSV41_CACHE."""
    from dsv41.demo import ensure_demo_checkpoint

    root = tmp_path_factory.getbasetemp() / "dsv41-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSV41_CACHE", str(root))
        return ensure_demo_checkpoint()


# ------------------------------------------------------------------------------------ servers
SERVER_CONTEXT = 1536


@pytest.fixture(scope="session")
def server_model(demo_dir):
    """The demo model as the server tests share it: fast numerics (dequantised weights, quicker) with
    invariant kernels (a position gives the same bits however calls are shaped, so alone = batched and
    speculative = plain stay exact)."""
    import dsv41
    from dsv41.config import RuntimeConfig
    from dsv41.tokenizer import Tokenizer
    return dsv41.load(demo_dir, RuntimeConfig(max_seq_len=SERVER_CONTEXT, max_batch_size=4, numerics="fast", kernels="invariant")), \
        Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="session")
def start_server(server_model):
    """Start a server on loopback on the shared model (`load` replaces the loading), stopped at the
    session's end."""
    from dsv41.server.app import ServerConfig
    from serving import LiveServer
    started = []

    def start(load=None, wait_ready=True, **config):
        settings = dict(model_name="demo", max_batch=4, max_context=SERVER_CONTEXT, seed=0, max_body_bytes=1 << 20)
        server = LiveServer(load or (lambda: server_model), ServerConfig(**{**settings, **config}))
        started.append(server.start(wait_ready=wait_ready))
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def live(start_server):
    """A server with the demo model (no speculation)."""
    return start_server()


@pytest.fixture(scope="session")
def live_speculative(start_server):
    """The same model behind a second server that speculates with its DSpark stages."""
    return start_server(speculative=True)


@pytest.fixture(scope="session")
def cli_env(demo_dir):
    """The environment of a `python -m dsv41` subprocess: the session's random demo as the default model
    (its choices bind and tie), this checkout on the path, one intra-op thread, no --debug."""
    from pathlib import Path

    env = dict(os.environ, DSV41_CACHE=str(demo_dir.parent), DSV41_DEMO="random", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    env.pop("DSV41_DEBUG", None)
    return env
