"""Single-process pieces of `serve`: the synthetic workload, launcher helpers, the CLI digest."""

from __future__ import annotations

import signal
import socket
import time

import numpy as np
import pytest

from xllm_eplb.engine.tokenizer import load_tokenizer
from xllm_eplb.engine.workload import SyntheticWorkload, topic_of_rank, zipf_probs
from xllm_eplb.flags import config_from_dict
from xllm_eplb.launcher import Progress, StartupError, check_port, describe_exit, ready_line
from xllm_eplb.model.checkpoint import read_topics
from xllm_eplb.model.default_checkpoint import with_default_checkpoint


def test_zipf_probs_and_drift_rotation():
    p = zipf_probs(4, 1.0)
    np.testing.assert_allclose(p, np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12))
    np.testing.assert_allclose(zipf_probs(5, 0.0), 0.2)
    assert [topic_of_rank(0, t, 4, 10.0) for t in (0, 9.9, 10, 25, 40)] == [0, 0, 1, 2, 0]
    assert topic_of_rank(2, 1e6, 4, 0.0) == 2                       # drift off


def test_workload_requests_are_topic_tokens_and_skewed():
    cfg = with_default_checkpoint(config_from_dict({
        "ep_size": 4, "workload": "synthetic", "workload_prompt_len": 9,
        "workload_output_len": 5, "workload_skew": 2.0, "workload_drift_seconds": 100.0}))
    sent = []
    wl = SyntheticWorkload(cfg, sent.append, seed=3, clock=lambda: 0.0)
    info = read_topics(cfg.model.model)               # the generated checkpoint's topic rule
    T, (lo, hi) = info["num_topics"], info["text_token_ids"]
    assert T == 16 and wl.num_topics == T
    tok_topic = np.arange(cfg.model.vocab_size) % T
    bos = load_tokenizer(cfg.model.model).bos_id
    hist = np.zeros(T, int)
    for _ in range(300):
        r = wl.make_request(0.0)
        assert r.prompt[0] == bos and len(r.prompt) == 9 and r.max_tokens == 5
        assert all(lo <= t < hi for t in r.prompt[1:])                 # ordinary tokens only
        assert r.source == "workload" and not r.stop_at_eos
        assert len({int(tok_topic[t]) for t in r.prompt[1:]}) == 1     # one topic per prompt
        hist[tok_topic[r.prompt[1]]] += 1
    assert hist.argmax() == 0 and hist[0] > 0.5 * 300                  # Zipf(2): rank 0 ~ 61 %
    later = [wl.make_request(150.0) for _ in range(200)]                # shift = 1
    assert np.bincount([tok_topic[r.prompt[1]] for r in later], minlength=T).argmax() == 1


def test_workload_skips_arrivals_over_the_backlog():
    cfg = with_default_checkpoint(config_from_dict({"ep_size": 4, "workload": "synthetic",
                                                    "workload_rate": 500.0}))
    sent = []
    wl = SyntheticWorkload(cfg, sent.append, backlog=lambda: len(sent), max_backlog=3)
    wl.start()
    deadline = time.monotonic() + 5
    while wl.skipped < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    wl.close()
    assert len(sent) == 3 and wl.skipped >= 5


def test_check_port_and_ready_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(StartupError, match=f"--port={port}"):
            check_port("127.0.0.1", port)
    assert check_port("127.0.0.1", 0) > 0
    cfg = config_from_dict({"ep_size": 4, "port": 8123})
    assert ready_line(cfg) == "xllm-eplb ready ep_size=4 backend=gloo url=http://127.0.0.1:8123"


def test_describe_exit():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3" and describe_exit(None) == "still running"


def test_plain_progress_prints_one_line_per_completed_stage(capsys):
    p = Progress(2, tty=False)
    p.update("ep0", "dist_init")
    assert capsys.readouterr().err == ""
    p.update("ep1", "dist_init")
    p.update("engine", "warmup")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("xllm-eplb start stage=dist_init ranks=2/2")
    assert err[1].startswith("xllm-eplb start engine=warmup")
    p.close()


def test_tty_progress_draws_each_row_once(capsys):
    """Regression: the live `rich` display redrew its rows around the engine's own log lines
    (`EPLB manager start`, `engine ready`) on a terminal."""
    p = Progress(2, tty=True)
    for who in ("ep0", "ep1"):
        p.update(who, "model")
    p.update("engine", "ready")
    p.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("xllm-eplb start stage=model ranks=2/2")
    assert err[1].startswith("xllm-eplb start engine=ready")


def test_serve_digest_lists_non_defaults():
    from xllm_eplb.commands.serve import digest

    cfg = config_from_dict({"ep_size": 4, "eplb_update_interval": 5.0})
    assert digest(cfg) == "ep_size=4 eplb_update_interval=5"


def test_unusable_log_dir_is_a_startup_error_before_any_process(tmp_path):
    """Regression: an uncreatable --log_dir was a FileNotFoundError traceback (exit 1)."""
    from xllm_eplb.launcher import serve

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = config_from_dict({"ep_size": 2, "log_dir": str(blocker / "logs"), "port": 0})
    with pytest.raises(StartupError, match="--log_dir=.*cannot create or write"):
        serve(cfg)


def test_bench_bad_url_or_json_path_is_exit_2():
    """Regression: a bad --url exited 1 and a bad --json path was a traceback after the run."""
    from click.testing import CliRunner

    from xllm_eplb.commands.bench import bench

    r = CliRunner().invoke(bench, ["--url", "notaurl", "--requests", "1"])
    assert r.exit_code == 2 and "--url=notaurl: unknown url type" in r.output
    r = CliRunner().invoke(bench, ["--url", "http://127.0.0.1:1", "--json", "/proc/no/x.json"])
    assert r.exit_code == 2 and "--json=/proc/no/x.json: folder /proc/no does not exist" in r.output


def test_a_stop_during_start_up_is_one_line_and_mutes_the_stages(capsys):
    # issue 41 item 1: the console kept printing `stage=spawned ... ready` after the stop
    p = Progress(2, False)
    p.update("ep0", "spawned")
    p.stopping(signal.SIGINT, {"engine": 0, "ep0": 0})
    p.stopping(signal.SIGTERM, {"engine": 0, "ep0": 0})       # a second signal: no new line
    p.update("ep1", "spawned")
    p.update("engine", "ready")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("xllm-eplb stop requested during start-up "
                                               "(SIGINT at t="), err
    assert err[0].endswith("): stopping the engine and 1 of 2 workers"), err
