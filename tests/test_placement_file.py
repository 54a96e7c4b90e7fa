"""``--eplb_init_placement=FILE``: a `plan --output` file is read back exactly; every rule a bad
file breaks is one `error:` line naming the file, the field and the rule, exit 2, from
`config validate` (in process) and from `serve` (a real process, nothing left behind)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from xllm_eplb.cli import cli
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.eplb.placement_file import initial_placement, read_placement_file
from xllm_eplb.errors import InputFileError
from xllm_eplb.flags import config_from_dict

E, D, R, L = 16, 4, 1, 2          # the checkpoint below: 16 experts, 3 layers (1 dense)
W = D * (E // D + R)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from xllm_eplb.model.checkpoint import make_checkpoint

    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ckpt") / "tiny",
                           num_layers=3, first_k_dense=1, num_experts=E, top_k=2)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """A real `xllm-eplb plan --output` for that model's shape (skewed load)."""
    d = tmp_path_factory.mktemp("plan")
    load = np.arange(1, L * E + 1, dtype=np.int64).reshape(L, E) ** 2
    (d / "load.json").write_text(json.dumps({"logical_count": load.tolist()}))
    r = CliRunner().invoke(cli, ["plan", "--load", str(d / "load.json"), "--ep-size", str(D),
                                 "--redundant-experts-num", str(R), "--output",
                                 str(d / "placement.json")])
    assert r.exit_code == 0, r.output
    return d / "placement.json"


def _read(path):
    return read_placement_file(str(path), num_logical=E, ep_size=D, redundant=R,
                               num_moe_layers=L)


def test_a_plan_output_reads_back_exactly(plan_file):
    data = json.loads(plan_file.read_text())
    table = _read(plan_file)
    assert table.dtype == np.int64 and table.tolist() == data["phy2log"]
    assert not np.array_equal(table[0], initial_phy2log(E, D, R))   # the plan moved experts


def test_initial_placement_default_and_file(plan_file):
    base = dict(ep_size=D, num_experts=E, num_layers=L + 1, first_k_dense_replace=1,
                num_experts_per_tok=2)
    cfg = config_from_dict(base)
    assert initial_placement(cfg).tolist() == [initial_phy2log(E, D, R).tolist()] * L
    cfg = config_from_dict({**base, "eplb_init_placement": str(plan_file)})
    assert initial_placement(cfg).tolist() == json.loads(plan_file.read_text())["phy2log"]


def _bad(plan_file, tmp_path, edit):
    data = json.loads(plan_file.read_text())
    edit(data)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return p


def _set(key, value):
    def f(d):
        d[key] = value
    return f


def _cell(layer, slot, value):
    def f(d):
        d["phy2log"][layer][slot] = value
    return f


def _drop_expert(d):
    row = d["phy2log"][1]
    missing = row[0]
    d["phy2log"][1] = [x if x != missing else (missing + 1) % E for x in row]


CASES = [
    ("ep_size", _set("ep_size", 8), "ep_size=8: must equal the server's --ep_size=4"),
    ("experts", _set("num_logical_experts", 32),
     "num_logical_experts=32: must equal the model's 16 routed experts per layer"),
    ("slots", _set("slots_per_rank", 6), "slots_per_rank=6: must equal num_experts / ep_size + "
                                         "--redundant_experts_num = 16/4+1 = 5"),
    ("moe_layers", _set("moe_layers", [0, 1]), "moe_layers=[0, 1]: must be [0, 2]"),
    ("missing", lambda d: d.pop("slots_per_rank"), "missing key 'slots_per_rank'"),
    ("rows", lambda d: d["phy2log"].pop(), "phy2log has 1 rows: must have one per MoE layer "
                                           "of the model (2)"),
    ("width", lambda d: d["phy2log"][1].pop(), "phy2log[1] has 19 slots: must have ep_size * "
                                               "slots_per_rank = 20"),
    ("float id", _cell(0, 3, 2.5), "phy2log[0][3]=2.5: must be an integer expert id"),
    ("bool id", _cell(0, 3, True), "phy2log[0][3]=true: must be an integer expert id"),
    ("range", _cell(1, 7, 16), "phy2log[1]: slot 7 holds expert 16, outside [0, 16)"),
    ("negative", _cell(1, 7, -1), "phy2log[1]: slot 7 holds expert -1, outside [0, 16)"),
    ("unplaced", _drop_expert, "phy2log[1]: logical expert"),
]


@pytest.mark.parametrize("name,edit,msg", CASES, ids=[c[0] for c in CASES])
def test_each_rule_is_one_error_naming_file_and_field(plan_file, tmp_path, ckpt, name, edit,
                                                      msg):
    p = _bad(plan_file, tmp_path, edit)
    with pytest.raises(InputFileError) as e:
        _read(p)
    assert str(e.value).startswith(f"--eplb_init_placement={p}: ") and msg in str(e.value)
    r = CliRunner().invoke(cli, ["config", "validate", "--model", str(ckpt), "--ep-size", "4",
                                 "--port", "0", f"--eplb_init_placement={p}"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --eplb_init_placement=") \
        and msg in lines[0], r.output


@pytest.mark.parametrize("text,msg", [
    ("[[0, 1]]", "expected a JSON object as `xllm-eplb plan --output` writes, got a list"),
    ("{oops", "invalid JSON"),
])
def test_not_a_plan_file(tmp_path, text, msg):
    p = tmp_path / "x.json"
    p.write_text(text)
    with pytest.raises(InputFileError, match=msg):
        _read(p)
    with pytest.raises(InputFileError, match="placement file not found"):
        _read(tmp_path / "none.json")


def test_validate_accepts_the_plan(plan_file, ckpt):
    r = CliRunner().invoke(cli, ["config", "validate", "--model", str(ckpt), "--ep-size", "4",
                                 "--port", "0", f"--eplb_init_placement={plan_file}"])
    assert r.exit_code == 0 and "configuration is valid" in r.output, r.output


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_serve_with_a_bad_file_exits_2_and_leaves_nothing(plan_file, tmp_path, ckpt):
    from xllm_eplb.testing.serving import free_port, shm_objects

    p = _bad(plan_file, tmp_path, _set("ep_size", 2))
    port = free_port()
    logs = tmp_path / "logs"
    r = subprocess.run([sys.executable, "-m", "xllm_eplb", "serve", "--model", str(ckpt),
                        "--ep-size", "4", "--port", str(port), "--log_dir", str(logs),
                        f"--eplb_init_placement={p}"], capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"error: --eplb_init_placement={p}: ep_size=2: must equal the "
                                f"server's --ep_size=4"), r.stderr
    assert not logs.exists() and shm_objects(f"p{port}") == []
