"""`xllm-eplb plan --format`: each engine's placement file, read back by a checker that follows
that engine's documented rules (and by SGLang's own map builder where SGLang imports); bad files
are refused naming the rule; TensorRT-LLM statistic folders as --load."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from xllm_eplb.commands.plan import plan
from xllm_eplb.integrations import formats
from xllm_eplb.integrations.recordings import read_trtllm_statistics

EP, RED, E, DENSE, MOE = 4, 1, 16, 2, 5


@pytest.fixture()
def load_file(tmp_path):
    rng = np.random.default_rng(0)
    rows = [[0] * E] * DENSE + (rng.zipf(1.5, (MOE, E)) * 10).tolist()
    p = tmp_path / "loads.json"
    p.write_text(json.dumps({"logical_count": rows}))
    return p


def run_plan(tmp_path, load, fmt, *extra):
    out = tmp_path / f"out{formats.SUFFIX[fmt]}"
    r = CliRunner().invoke(plan, ["--load", str(load), "--ep-size", str(EP),
                                  "--redundant-experts-num", str(RED), "--policy", "incremental",
                                  "--format", fmt, "-o", str(out), *extra])
    assert r.exit_code == 0, r.output
    assert f"format={fmt}" in r.output
    return out


def fresh_table(load, layers=slice(None), repeats=True):
    """Another engine's file: nothing of ours is deployed there, so every MoE layer is planned
    fresh by the adapters' planner (not from xLLM's initial layout, as the native plan is)."""
    from xllm_eplb.integrations.core import plan_physical

    moe = np.asarray(json.loads(load.read_text())["logical_count"])[DENSE:][layers]
    return plan_physical(moe, EP * (E // EP + RED), EP, kind="incremental", rank_repeats=repeats)


def test_sglang_file(tmp_path, load_file):
    want = fresh_table(load_file)
    t = formats.check_sglang(run_plan(tmp_path, load_file, "sglang"), num_layers=DENSE + MOE,
                             num_physical=EP * (E // EP + RED), num_logical=E, ep_size=EP,
                             dense=DENSE)
    assert np.array_equal(t[DENSE:], want)
    assert np.array_equal(t[0], np.arange(t.shape[1]) % E)         # dense: SGLang's trivial map
    try:                                   # SGLang's own logical map builder, where it imports
        import torch
        from sglang.srt.eplb.expert_location import _compute_logical_to_all_physical_map
    except Exception:
        return
    m = _compute_logical_to_all_physical_map(torch.tensor(t), E, EP, moe_ep_rank=None)
    assert all(len(m[i][e]) >= 1 for i in range(len(m)) for e in range(E))


def test_vllm_ascend_file(tmp_path, load_file):
    want = fresh_table(load_file, repeats=False)
    t = formats.check_vllm_ascend(run_plan(tmp_path, load_file, "vllm-ascend"),
                                  num_moe_layers=MOE, ep_size=EP, num_logical=E)
    assert np.array_equal(t.reshape(MOE, -1), want)


def test_trtllm_file_keys_are_decoder_layer_indices(tmp_path, load_file):
    want = fresh_table(load_file, slice(1, 3))
    out = run_plan(tmp_path, load_file, "trtllm", "--moe-layers", "1:3")
    t = formats.check_trtllm(out, dense=DENSE, num_moe_layers=MOE, num_logical=E, ep_size=EP)
    assert np.array_equal(t[1:3], want)
    assert np.array_equal(t[0], np.arange(t.shape[1]) % E)         # not planned: trivial map
    assert out.read_text().splitlines()[2].startswith(f"  {DENSE}: [")


@pytest.mark.parametrize("fmt,breakage,rule", [
    ("sglang", lambda d: d.update(ep_size=4), "single key"),
    ("sglang", lambda d: d["physical_to_logical_map"].pop(), "decoder layers"),
    ("sglang", lambda d: d["physical_to_logical_map"][3].__setitem__(0, 99), "outside"),
    ("vllm-ascend", lambda d: d.update(moe_layer_count=4), "moe_layer_count"),
    ("vllm-ascend", lambda d: d["layer_list"][0]["device_list"][0]["device_expert"].__setitem__(
        1, d["layer_list"][0]["device_list"][0]["device_expert"][0]), "twice"),
    ("vllm-ascend", lambda d: d["layer_list"][1]["device_list"].pop(), "device_count"),
])
def test_checkers_refuse_broken_json(tmp_path, load_file, fmt, breakage, rule):
    out = run_plan(tmp_path, load_file, fmt)
    d = json.loads(out.read_text())
    breakage(d)
    out.write_text(json.dumps(d))
    check = {"sglang": lambda p: formats.check_sglang(
        p, num_layers=DENSE + MOE, num_physical=EP * (E // EP + RED), num_logical=E,
        ep_size=EP, dense=DENSE),
        "vllm-ascend": lambda p: formats.check_vllm_ascend(p, num_moe_layers=MOE, ep_size=EP,
                                                           num_logical=E)}[fmt]
    with pytest.raises(formats.FormatError, match=rule):
        check(out)


@pytest.mark.parametrize("edit,rule", [
    (lambda s: s.replace("num_slots: 20", "num_slots: 21"), "num_slots"),
    (lambda s: s.replace(f"  {DENSE}: [", "  0: ["), "keys"),
    (lambda s: s.replace("layer_updates_per_iter: 0", "layer_updates_per_iter: 2"), "static"),
])
def test_trtllm_checker_refuses(tmp_path, load_file, edit, rule):
    out = run_plan(tmp_path, load_file, "trtllm")
    out.write_text(edit(out.read_text()))
    with pytest.raises(formats.FormatError, match=rule):
        formats.check_trtllm(out, dense=DENSE, num_moe_layers=MOE, num_logical=E, ep_size=EP)


def test_trtllm_statistic_folder_as_load(tmp_path, load_file):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    d = tmp_path / "stats"
    d.mkdir()
    (d / "meta_info.json").write_text(json.dumps({"num_experts": E, "num_experts_per_token": 2}))
    want = np.zeros((MOE, E), np.int64)
    for rank in range(2):
        tensors = {}
        for it in range(3):
            for layer in range(DENSE, DENSE + MOE):
                c = rng.integers(0, 50, E).astype(np.int32)
                tensors[f"{it}_{layer}"] = c
                want[layer - DENSE] += c
        save_file(tensors, str(d / f"rank{rank}.safetensors"))
    lf = read_trtllm_statistics(d)
    assert lf.dense_skipped == DENSE and np.array_equal(lf.loads, want)
    out = run_plan(tmp_path, d, "trtllm")
    formats.check_trtllm(out, dense=DENSE, num_moe_layers=MOE, num_logical=E, ep_size=EP)


def test_bad_statistic_folder_is_one_error_line(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    r = CliRunner().invoke(plan, ["--load", str(d), "--ep-size", "4", "-o",
                                  str(tmp_path / "o.json")])
    assert r.exit_code == 2 and "meta_info.json" in r.output
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("fmt", ["sglang", "vllm-ascend", "trtllm"])
def test_other_engines_files_plan_expert_counts_the_ranks_do_not_divide(tmp_path, fmt):
    """6 experts on 4 ranks (vLLM's and TensorRT-LLM's test shape): refused for this engine's
    own file, planned for the others (ceil(6/4) + 1 = 3 slots per rank; an expert twice on a rank
    only where that engine routes over such replicas and the peak drops)."""
    rows = [[0] * 6] + [[60, 10, 30, 5, 80, 15], [1, 2, 3, 4, 5, 6]]
    load = tmp_path / "six.json"
    load.write_text(json.dumps(rows))
    args = ["--load", str(load), "--ep-size", "4", "--redundant-experts-num", "1"]
    r = CliRunner().invoke(plan, [*args, "-o", str(tmp_path / "n.json")])
    assert r.exit_code == 2 and "not divisible by --ep-size=4" in r.output
    out = tmp_path / f"o{formats.SUFFIX[fmt]}"
    r = CliRunner().invoke(plan, [*args, "--format", fmt, "-o", str(out)])
    assert r.exit_code == 0, r.output
    if fmt == "sglang":
        t = formats.check_sglang(out, num_layers=3, num_physical=12, num_logical=6, ep_size=4,
                                 dense=1)[1:]
    elif fmt == "vllm-ascend":
        t = formats.check_vllm_ascend(out, num_moe_layers=2, ep_size=4, num_logical=6)
    else:
        t = formats.check_trtllm(out, dense=1, num_moe_layers=2, num_logical=6, ep_size=4)
    t = np.asarray(t).reshape(2, 4, 3)
    assert all(set(layer.ravel()) == set(range(6)) for layer in t)
    if fmt == "vllm-ascend":                  # its worker refuses an expert twice on a device
        assert all(len(set(rank)) == 3 for layer in t for rank in layer)
    else:       # SGLang and TensorRT-LLM route over repeats: taken only where the peak drops
        from xllm_eplb.eplb.balance import rank_loads_from_phy2log
        from xllm_eplb.integrations.core import plan_physical

        w = np.asarray(rows[1:])
        strict = plan_physical(w, 12, 4, kind="incremental", rank_repeats=False)
        peak = rank_loads_from_phy2log(t.reshape(2, -1), w, 4).max(axis=1)
        assert (peak <= rank_loads_from_phy2log(strict, w, 4).max(axis=1)).all()
