"""`config validate` runs every check `serve` runs before it starts, each blaming its own flag
(real sockets, real folders)."""

from __future__ import annotations

import os
import socket

import pytest
from click.testing import CliRunner

from xllm_eplb.cli import cli
from xllm_eplb.flags import config_from_dict
from xllm_eplb.preflight import StartupError, check_serve


def _validate(*flags: str):
    return CliRunner().invoke(cli, ["config", "validate", "--ep-size", "4", "--port", "0",
                                    *flags])


def test_validate_passes_on_a_good_config(tmp_path):
    r = _validate("--log_dir", str(tmp_path / "new" / "logs"))
    assert r.exit_code == 0 and "configuration is valid" in r.output, r.output
    assert not (tmp_path / "new").exists()          # validate creates nothing
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    r = _validate("--log_dir", str(ro / "logs"))
    if os.geteuid() != 0:                            # root writes into a 0555 folder
        assert r.exit_code == 2 and "--log_dir=" in r.output, r.output
    assert not (ro / "logs").exists()


@pytest.mark.parametrize("flags,msg", [
    (["--host", "no-such-host.invalid"], "--host=no-such-host.invalid: cannot resolve"),
    (["--host", "192.0.2.77"], "--host=192.0.2.77: not an address of this machine"),
    (["--log_dir", "/etc/hostname/logs"], "--log_dir=/etc/hostname/logs: cannot create or "
                                          "write the log folder (/etc/hostname is not a folder)"),
    (["--device", "cuda"], "--device=cuda"),
    # regression: root passes every permission-bit check, /proc takes no new folder
    (["--log_dir", "/proc/xllm-eplb-nope/logs"], "--log_dir=/proc/xllm-eplb-nope/logs: cannot "
                                                 "create or write the log folder"),
    # regression: validate skipped the --model checks serve runs first
    (["--model", "/no/such/ckpt"], "--model=/no/such/ckpt: not a folder"),
    (["--routing_mode", "trace", "--routing_trace", "/no/such/trace.npy"], "/no/such/trace.npy"),
    (["--num_experts_per_tok", "65"], "--num_experts_per_tok=65: must be <= --num_experts=64"),
    (["--n_shared_experts", "0"], "n_shared_experts=0: the generated deepseek_v3 checkpoint"),
])
def test_validate_blames_the_right_flag(flags, msg):
    r = _validate(*flags)
    assert r.exit_code == 2 and msg in r.output, r.output
    assert "--port" not in r.output


def test_a_taken_port_blames_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = CliRunner().invoke(cli, ["config", "validate", "--ep-size", "4", "--port",
                                     str(port)])
        assert r.exit_code == 2 and f"--port={port}: cannot listen" in r.output, r.output
        cfg = config_from_dict({"ep_size": 4, "port": port})
        with pytest.raises(StartupError, match=f"--port={port}"):
            check_serve(cfg)
