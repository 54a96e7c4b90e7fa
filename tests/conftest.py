"""Shared pytest fixtures (keep minimal)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from xllm_eplb.testing.serving import Server

# the long fuzz runs (docs/reliability.md): pytest ... --hypothesis-profile=fuzz-long
settings.register_profile("fuzz-long", max_examples=3000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Generated default checkpoints go to one folder of this session (the servers the tests
    start inherit it), not the clone's .cache/checkpoints (issue 35); removed at the end."""
    import os
    import tempfile

    from xllm_eplb.model.default_checkpoint import CACHE_ENV

    if not os.environ.get(CACHE_ENV):
        config._xllm_cache = tempfile.mkdtemp(prefix="xllm_eplb_test_ckpts_")
        os.environ[CACHE_ENV] = config._xllm_cache


def pytest_unconfigure(config):
    import shutil

    d = getattr(config, "_xllm_cache", None)
    if d:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def run_id():
    """A fresh run id for tests that create shm objects; afterwards every object of it is
    removed and none may be left."""
    import os
    import uuid

    from xllm_eplb.ipc import objects
    from xllm_eplb.ipc.shm import run_prefix

    rid = "t" + uuid.uuid4().hex[:10]
    yield rid
    objects.clean(rid, force=True)
    assert not [f for f in os.listdir("/dev/shm") if run_prefix(rid) in f]


@pytest.fixture(scope="session")
def ds8_ckpt(tmp_path_factory) -> Path:
    """A generated deepseek_v3 checkpoint with 8 experts, top-2 (the serve-level fault and
    elastic tests); built once per session, read only."""
    from xllm_eplb.model.checkpoint import make_checkpoint

    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ds8_ckpt") / "c",
                           num_experts=8, top_k=2)


@pytest.fixture(scope="session")
def glm8_ckpt(tmp_path_factory) -> Path:
    """A generated glm4_moe checkpoint with 8 experts, top-2 (GQA with partial RoPE, sigmoid
    grouped routing, a shared expert): the elastic shrink test's model; read only."""
    from xllm_eplb.model.checkpoint import make_checkpoint

    return make_checkpoint("glm4_moe", tmp_path_factory.mktemp("glm8_ckpt") / "c",
                           num_experts=8, top_k=2)


@pytest.fixture
def repo_root() -> Path:
    """The repository root (the directory holding pyproject.toml)."""
    return REPO_ROOT


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data/sglang_ep_statistics`` (real DeepSeek load dumps); skips when absent."""
    path = (REPO_ROOT / ".." / "shared" / "data" / "sglang_ep_statistics").resolve()
    if not path.is_dir() or not any(path.glob("*.json")):
        pytest.skip(f"shared load data not found at {path} (the SGLang dumps: README.md, "
                    f"'Real DeepSeek-V3/R1 expert loads', says where they come from)")
    return path


@pytest.fixture(scope="session")
def hf_ckpts(tmp_path_factory) -> dict:
    """One tiny seeded checkpoint per family (per-expert keys), built once per session with
    transformers: family -> folder."""
    import hf_util

    root = tmp_path_factory.mktemp("hf_ckpts")
    return {f: hf_util.build(f, root / f, seed=i) for i, f in enumerate(hf_util.FAMILIES)}


@pytest.fixture
def start_server(tmp_path):
    """``start(*flags) -> Server``: real `xllm-eplb serve` runs, killed and swept after the test."""
    servers: list[Server] = []

    def start(*args: str, base: list[str] | None = None) -> Server:
        d = tmp_path / f"s{len(servers)}"
        d.mkdir()
        s = Server.launch(d, list(args), base)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.kill()
