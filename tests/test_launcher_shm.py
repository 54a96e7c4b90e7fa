"""The launcher's run shared memory against leftovers (real POSIX shm, a real second process):
objects a live process holds stop the start with the message docs/serving.md quotes; objects
nobody holds (a run killed with kill -9) are reclaimed by the next start with the same run id."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xllm_eplb.flags import config_from_dict
from xllm_eplb.ipc.objects import sweep_run
from xllm_eplb.launcher import RunShm, StartupError, resolve_runtime

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shm")


@pytest.fixture
def cfg():
    c = resolve_runtime(config_from_dict({"ep_size": 2, "port": 0,
                                          "run_id": f"t{os.getpid()}shm"}))
    yield c
    sweep_run(c.runtime.run_id)
    assert not [n for n in os.listdir("/dev/shm") if c.runtime.run_id in n]


def test_a_run_id_held_by_a_live_process_names_the_flag_and_the_holders(cfg):
    rid = cfg.runtime.run_id
    first = RunShm.create(cfg)
    try:
        with pytest.raises(StartupError) as e:
            RunShm.create(cfg)
    finally:
        first.close()
    msg = str(e.value)
    assert msg.startswith(f"--run_id={rid}: shared memory object /xllm_eplb_{rid}_in is in use "
                          f"by live processes (holders: [{os.getpid()}])"), msg
    assert msg.endswith("stop them or use another --run_id"), msg


@pytest.mark.timeout(120)
@pytest.mark.slow            # a killed child process (make test-fast skips it)
def test_objects_of_a_killed_run_are_reclaimed_by_the_next_start(cfg, caplog):
    rid = cfg.runtime.run_id
    code = ("import os, sys\n"
            "from xllm_eplb.flags import config_from_dict\n"
            "from xllm_eplb.launcher import RunShm, resolve_runtime\n"
            f"cfg = resolve_runtime(config_from_dict({{'ep_size': 2, 'port': 0, "
            f"'run_id': {rid!r}}}))\n"
            "RunShm.create(cfg)\n"
            "os._exit(0)        # as kill -9: nothing closed, nothing unlinked\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=100)
    assert [n for n in os.listdir("/dev/shm") if f"xllm_eplb_{rid}_in" in n]   # left behind
    with caplog.at_level(logging.INFO):
        again = RunShm.create(cfg)
    again.close()
    assert f"shm reclaim stale name=/xllm_eplb_{rid}_in" in caplog.text


def test_a_sweep_logs_one_summary_line_not_one_per_object(cfg, caplog):
    # issue 35: after a launcher kill the console showed 8-16 `shm clean removed` lines
    rid = cfg.runtime.run_id
    from xllm_eplb.ipc.objects import clean

    shm = RunShm.create(cfg)                # a killed run's objects (force: held here)
    objs = [n for n in os.listdir("/dev/shm") if rid in n]
    assert len(objs) >= 4
    with caplog.at_level(logging.INFO, logger="xllm_eplb"):
        removed = clean(rid, force=True)
    shm.close()
    lines = [r for r in caplog.records if "shm clean removed" in r.getMessage()
             and r.levelno >= logging.INFO]
    assert len(removed) == len(objs) and len(lines) == 1, caplog.text
    assert f"objects={len(objs)} runs={rid}" in lines[0].getMessage()
