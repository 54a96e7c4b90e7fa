"""--worker_cpu_affinity: the plan (auto / none / LIST), its errors, and a real spawned child
that starts on the cores it was given."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from xllm_eplb.errors import ConfigError
from xllm_eplb.worker import affinity


def test_auto_splits_the_cores_and_gives_the_engine_what_is_left_over():
    p = affinity.plan("auto", 2, tuple(range(9)))
    assert p.engine == (0,) and p.workers == ((1, 2, 3, 4), (5, 6, 7, 8)) and p.pinned
    p = affinity.plan("auto", 4, (0, 1, 2, 3, 4))
    assert p.workers == ((1,), (2,), (3,), (4,))
    p = affinity.plan("auto", 8, tuple(range(16)))      # the device machine at EP8
    assert p.workers == tuple((2 * i, 2 * i + 1) for i in range(8)) and p.engine is None
    assert p.note == "worker_cpu_affinity=auto: 2 core(s) per worker, engine on the workers' " \
                     "cores (it runs while they wait for its next step)"


def test_auto_on_this_two_core_machine():
    p = affinity.plan("auto", 1, (0, 1))                # EP1: both cores for the one worker
    assert p.workers == ((0, 1),) and p.engine is None
    p = affinity.plan("auto", 2, (0, 1))                # EP2: a core each
    assert p.workers == ((0,), (1,)) and p.engine is None
    p = affinity.plan("auto", 3, (0, 1, 2, 3, 4))       # 5 cores, EP3: engine on the spares
    assert p.workers == ((2,), (3,), (4,)) and p.engine == (0, 1)
    assert p.note.endswith("engine on core(s) 0-1")


def test_auto_leaves_one_core_workers_unpinned_with_the_shm_all_to_all():
    # 2 cores, EP2, shm: a pinned rank would sleep in a round behind the engine on its core
    p = affinity.plan("auto", 2, (0, 1), shm=True)
    assert not p.pinned and p.engine is None
    assert p.note == ("worker_cpu_affinity=auto: 2 cores for 2 workers and the engine with the "
                      "shm all-to-all: not pinned (a pinned rank would wait behind the engine "
                      "on its core)")
    # a core left for the engine, several cores per worker, or EP1: pinned as without shm
    assert affinity.plan("auto", 2, (0, 1, 2), shm=True).workers == ((1,), (2,))
    assert affinity.plan("auto", 2, tuple(range(4)), shm=True).workers == ((0, 1), (2, 3))
    assert affinity.plan("auto", 1, (0, 1), shm=True).workers == ((0, 1),)
    assert affinity.plan("0,1", 2, (0, 1), shm=True).workers == ((0,), (1,))


def test_auto_falls_back_to_none_with_too_few_cores():
    p = affinity.plan("auto", 4, (0, 1))                # this 2-core machine at EP4
    assert not p.pinned and p.engine is None
    assert p.note == "worker_cpu_affinity=auto: 2 cores for 4 workers: not pinned (needs 4)"
    assert not affinity.plan("none", 2, tuple(range(64))).pinned


def test_list_gives_each_rank_its_entry():
    p = affinity.plan("0,1", 2, (0, 1))
    assert p.workers == ((0,), (1,)) and p.engine is None
    assert affinity.plan("0-1,2+4", 2, tuple(range(8))).workers == ((0, 1), (2, 4))


@pytest.mark.parametrize("spec,msg", [
    ("0,2", "--worker_cpu_affinity=0,2: core 2 is not available (this machine lets serve use "
            "cores 0-1: 2 for 2 ranks)"),
    ("0,0", "core 0 is given to ranks 0 and 1"),
    ("0", "1 entries for 2 EP ranks on this node"),
    ("a,b", "'a' is not a core"),
    ("3-1,0", "range '3-1' is empty"),
])
def test_list_errors_name_the_flag_value_and_rule(spec, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        affinity.plan(spec, 2, (0, 1))


def _report(q):
    q.put(sorted(os.sched_getaffinity(0)))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_child_spawned_inside_pinned_starts_on_those_cores():
    cpus = sorted(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with affinity.pinned((cpus[-1],)):
        p = ctx.Process(target=_report, args=(q,))
        p.start()
    assert os.sched_getaffinity(0) == before            # the launcher's mask is restored
    try:
        assert q.get(timeout=50) == [cpus[-1]]
    finally:
        p.join(10)
    assert affinity.apply(None) == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_serve_with_a_core_the_machine_lacks_exits_2_before_starting(tmp_path):
    import subprocess
    import sys

    bad = max(os.sched_getaffinity(0)) + 1
    r = subprocess.run([sys.executable, "-m", "xllm_eplb", "serve", "--ep-size", "2",
                        f"--worker_cpu_affinity=0,{bad}", "--port", "0",
                        "--log_dir", str(tmp_path / "logs")],
                       capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith(f"error: --worker_cpu_affinity=0,{bad}: core {bad} is not "
                                f"available"), r.stderr
    assert "xllm-eplb ready" not in r.stdout


def test_the_shared_cores_note_names_the_engine_only_where_it_runs():
    # issue 35: node 1's note said "+ the engine"; node n runs workers only
    from xllm_eplb.flags import load_config
    from xllm_eplb.launcher import console_notes

    cores = len(affinity.available_cpus())
    ep = 4 * cores                        # more workers per node than cores, on both nodes
    unpinned = affinity.plan("none", ep // 2)
    for node, who in ((0, f"{ep // 2} workers + the engine share"),
                      (1, f"{ep // 2} workers share")):
        cfg, _ = load_config(["--ep-size", str(ep), "--nnodes", "2", "--node-rank", str(node),
                              "--master-port", "29500", "--workload=synthetic"])
        notes = console_notes(cfg, unpinned)
        assert any(who in n for n in notes), notes
        assert any("workload is on" in n for n in notes) == (node == 0)
