"""gflags tokenizer, config files, flagfiles and precedence (xllm_eplb/flags.py)."""

from __future__ import annotations

import json
import logging

import pytest

from xllm_eplb.config import FIELDS, Config
from xllm_eplb.errors import ConfigError, UserError
from xllm_eplb.flags import config_from_dict, load_config, read_config_file

BASE = ["--ep_size=16"]


def load(*argv: str, **kw) -> Config:
    return load_config(list(argv), **kw)[0]


# --- token forms ------------------------------------------------------------------------------

def test_equals_and_space_forms_and_dashes():
    a = load("--ep_size=16", "--eplb_update_interval=5")
    b = load("--ep-size", "16", "--eplb-update-interval", "5")
    assert a == b
    assert a.eplb.ep_size == 16 and a.eplb.eplb_update_interval == 5.0


def test_types_are_from_the_schema():
    c = load(*BASE, "--eplb_update_interval=0.25", "--port", "9001", "--device=cpu",
             "--enable_fused_mc2", "-1", "--master_addr=10.0.0.1")
    assert isinstance(c.eplb.eplb_update_interval, float) and c.eplb.eplb_update_interval == 0.25
    assert c.serve.port == 9001 and isinstance(c.serve.port, int)
    assert c.eplb.enable_fused_mc2 == -1
    assert c.runtime.master_addr == "10.0.0.1"


@pytest.mark.parametrize("tok,want", [
    ("--enable_eplb", True), ("--enable-eplb", True), ("--noenable_eplb", False),
    ("--no-enable-eplb", False), ("--no_enable_eplb", False), ("--enable_eplb=true", True),
    ("--enable_eplb=FALSE", False), ("--enable_eplb=1", True), ("--enable_eplb=0", False),
    ("--enable_eplb=Yes", True), ("--enable_eplb=no", False),
])
def test_boolean_forms(tok, want):
    assert load(*BASE, tok).eplb.enable_eplb is want


def test_boolean_with_separate_value():
    assert load(*BASE, "--enable_eplb", "false").eplb.enable_eplb is False
    c = load("--enable_eplb", "--ep_size", "16")  # next token is a flag: plain --name
    assert c.eplb.enable_eplb is True


def test_last_value_wins_within_a_source():
    c = load(*BASE, "--enable_eplb", "--noenable_eplb", "--port=1", "--port=2")
    assert c.eplb.enable_eplb is False and c.serve.port == 2


@pytest.mark.parametrize("argv,needle", [
    (["--enable_eplb=maybe"], "--enable_eplb=maybe: must be a boolean"),
    (["--ep_size=sixteen"], "--ep_size=sixteen: must be an integer"),
    (["--eplb_update_interval=soon"], "--eplb_update_interval=soon: must be a finite number"),
    (["--eplb_update_interval=nan"], "must be a finite number"),
    (["--noenable_eplb=1"], "takes no value"),
    (["--port"], "--port needs a value"),
    (["positional"], "unexpected argument 'positional'"),
    (["-v"], "unexpected argument '-v'"),
])
def test_bad_tokens(argv, needle):
    with pytest.raises(ConfigError) as e:
        load(*BASE, *argv)
    assert needle in str(e.value)


def test_unknown_flag_did_you_mean():
    with pytest.raises(ConfigError) as e:
        load(*BASE, "--eplb_update_intervall=3")
    msg = str(e.value)
    assert "unknown flag '--eplb_update_intervall'" in msg
    assert "did you mean --eplb_update_interval?" in msg
    with pytest.raises(ConfigError, match="did you mean --num_layers"):
        load(*BASE, "--nonum_layers")  # --no only negates booleans
    with pytest.raises(ConfigError) as e:
        load(*BASE, "--zzzzzz=1")
    assert "did you mean" not in str(e.value)


def test_config_error_is_a_user_error_with_exit_code_2():
    with pytest.raises(UserError) as e:
        load("--bogus")
    assert e.value.exit_code == 2


def test_ep_size_required_unless_told():
    with pytest.raises(ConfigError, match="--ep_size is required"):
        load()
    c = load(require_ep_size=False)
    assert c.eplb.ep_size is None


# --- config files -----------------------------------------------------------------------------

def test_flat_and_sectioned_yaml_are_equivalent(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("ep_size: 8\nenable_eplb: true\nnum_experts: 32\nport: 9000\n")
    sec = tmp_path / "sec.yaml"
    sec.write_text("eplb:\n  ep_size: 8\n  enable_eplb: yes\nmodel:\n  num_experts: 32\n"
                   "serve:\n  port: 9000\n")
    a, sa = load_config(["--config", str(flat)])
    b, sb = load_config([f"--config={sec}"])
    assert a == b and a.eplb.ep_size == 8 and a.model.num_experts == 32 and a.serve.port == 9000
    assert sa["ep_size"] == sb["num_experts"] == "file" and sa["seed"] == "default"


def test_json_config(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"eplb": {"ep_size": 4}, "eplb_policy_kind": "Greedy"}))
    c = load("--config", str(p))
    assert c.eplb.ep_size == 4 and c.eplb.eplb_policy_kind == "greedy"


def test_json_syntax_error_names_line(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{\n  "ep_size": 4,\n  oops\n}\n')
    with pytest.raises(ConfigError) as e:
        load("--config", str(p))
    assert f"{p}:3: JSON syntax error" in str(e.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("ep_size: 16\nnum_experts: 64\nmodel: [1, 2\nport: 1\n")
    with pytest.raises(ConfigError) as e:
        load("--config", str(p))
    msg = str(e.value)
    assert msg.startswith(f"config file {p}:") and "YAML syntax error" in msg
    line = int(msg.split(f"{p}:")[1].split(":")[0])
    assert line in (3, 4)
    assert "\n" not in msg


def test_unknown_key_in_file_names_line_and_suggests(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("eplb:\n  ep_size: 16\n  enable_epbl: true\n")
    with pytest.raises(ConfigError) as e:
        load("--config", str(p))
    msg = str(e.value)
    assert f"{p}:3" in msg and "unknown key 'enable_epbl'" in msg
    assert "did you mean --enable_eplb?" in msg


def test_key_in_wrong_section(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("eplb:\n  ep_size: 16\n  port: 80\n")
    with pytest.raises(ConfigError, match="key 'port' belongs to section 'serve', not 'eplb'"):
        load("--config", str(p))


def test_section_must_be_a_mapping(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("ep_size: 16\nmodel: 5\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: section 'model' must be a mapping"):
        load("--config", str(p))


def test_wrong_type_in_file_names_flag_and_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("ep_size: 16\nnum_experts: [64]\n")
    with pytest.raises(ConfigError) as e:
        load("--config", str(p))
    assert f"{p}:2" in str(e.value) and "--num_experts=[64]: must be an integer" in str(e.value)
    p.write_text("ep_size: 16\nnum_experts: 6.5\n")
    with pytest.raises(ConfigError, match="--num_experts=6.5: must be an integer"):
        load("--config", str(p))
    p.write_text("ep_size: 16\nenable_eplb: 2\n")
    with pytest.raises(ConfigError, match="must be a boolean"):
        load("--config", str(p))


def test_missing_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: not found"):
        load("--config", str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="cannot read"):
        load("--config", str(tmp_path))  # a directory
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load("--config", str(p))
    e = tmp_path / "empty.yaml"
    e.write_text("# nothing\n")
    assert read_config_file(e) == {}


def test_config_from_dict():
    c = config_from_dict({"eplb": {"ep_size": 4}, "num_experts": 8, "eplb_policy_kind": "hier"})
    assert c.eplb.ep_size == 4 and c.model.num_experts == 8
    assert c.eplb.eplb_policy_kind == "balanced"
    with pytest.raises(ConfigError, match="unknown key 'num_expert'"):
        config_from_dict({"num_expert": 8})
    with pytest.raises(ConfigError, match="--num_experts=8: must be divisible by --ep_size=3"):
        config_from_dict({"ep_size": 3, "num_experts": 8})


# --- flagfiles --------------------------------------------------------------------------------

def test_nested_flagfiles_relative_to_including_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").mkdir()
    (tmp_path / "a" / "top.flags").write_text(
        "# top\n\n--ep_size=8   # trailing comment\n--flagfile=b/inner.flags\n--port 7000\n")
    (tmp_path / "a" / "b" / "inner.flags").write_text(
        "--enable_eplb\n--eplb_policy_kind='node_aware'\n--config=../c.yaml\n")
    (tmp_path / "a" / "c.yaml").write_text("num_experts: 16\nport: 1\n")
    c, src = load_config([f"--flagfile={tmp_path / 'a' / 'top.flags'}"])
    assert c.eplb.ep_size == 8 and c.eplb.enable_eplb and c.serve.port == 7000
    assert c.eplb.eplb_policy_kind == "node_aware" and c.model.num_experts == 16
    assert src["ep_size"] == src["enable_eplb"] == src["port"] == "flagfile"
    assert src["num_experts"] == "file"


def test_flagfile_cycle_is_detected(tmp_path):
    (tmp_path / "x.flags").write_text("--flagfile=y.flags\n")
    (tmp_path / "y.flags").write_text("--ep_size=4\n--flagfile x.flags\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load("--flagfile", str(tmp_path / "x.flags"))


def test_flagfile_errors_name_file_and_line(tmp_path):
    p = tmp_path / "f.flags"
    p.write_text("--ep_size=4\n\n--eplb_update_intervall=3\n")
    with pytest.raises(ConfigError) as e:
        load("--flagfile", str(p))
    assert f"{p}:3" in str(e.value) and "did you mean --eplb_update_interval" in str(e.value)
    with pytest.raises(ConfigError, match="flagfile .*missing.flags: not found"):
        load("--flagfile", str(tmp_path / "missing.flags"))


# --- precedence -------------------------------------------------------------------------------

def test_precedence_with_all_four_sources(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("eplb:\n  ep_size: 16\n  eplb_update_interval: 100\n  redundant_experts_num: 2\n"
                   "  eplb_policy_kind: greedy\n")
    ff = tmp_path / "f.flags"
    ff.write_text("--eplb_update_interval=50\n--eplb_policy_kind=incremental\n")
    # token order deliberately reversed: cli first, then flagfile, then config
    c, src = load_config(["--eplb_policy_kind=BALANCED", f"--flagfile={ff}", "--config", str(cfg)])
    assert (c.eplb.redundant_experts_num, src["redundant_experts_num"]) == (2, "file")
    assert (c.eplb.eplb_update_interval, src["eplb_update_interval"]) == (50.0, "flagfile")
    assert (c.eplb.eplb_policy_kind, src["eplb_policy_kind"]) == ("balanced", "cli")
    assert (c.model.num_experts, src["num_experts"]) == (64, "default")
    assert set(src.values()) == {"default", "file", "flagfile", "cli"}
    assert set(src) == set(FIELDS)


def test_cli_wins_over_file_even_for_booleans(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("ep_size: 16\nenable_eplb: true\n")
    c, src = load_config(["--noenable_eplb", "--config", str(cfg)])
    assert c.eplb.enable_eplb is False and src["enable_eplb"] == "cli"


def test_later_config_file_overrides_earlier(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("ep_size: 16\nport: 1\n")
    b.write_text("port: 2\n")
    assert load("--config", str(a), "--config", str(b)).serve.port == 2


def test_unknown_policy_is_an_error_at_validation_the_loop_keeps_the_fallback(caplog, tmp_path):
    """An unknown --eplb_policy_kind is exit 2 wherever a config is read (flag, config file);
    a value that reaches the rebalance loop another way still falls back to greedy with one
    warning (xLLM's rule), and legacy names still mean balanced."""
    from xllm_eplb.eplb.policy import make_policy

    with pytest.raises(ConfigError, match=r"--eplb_policy_kind=Fancy_Policy_XYZ: must be one "
                                          r"of balanced, greedy, incremental, node_aware"):
        load(*BASE, "--eplb_policy_kind=Fancy_Policy_XYZ")
    p = tmp_path / "c.yaml"
    p.write_text("eplb:\n  eplb_policy_kind: nope\n")
    with pytest.raises(ConfigError, match="--eplb_policy_kind=nope"):
        load(*BASE, "--config", str(p))
    assert load(*BASE, "--eplb_policy_kind=DeepSeek_Hier").eplb.eplb_policy_kind == "balanced"
    with caplog.at_level(logging.WARNING, logger="xllm_eplb.config"):
        pol = make_policy("Fancy_Policy_XYZ", 4, 16, 1)
        make_policy("Fancy_Policy_XYZ", 4, 16, 1)
    assert type(pol).__name__ == "GreedyPolicy"
    hits = [r for r in caplog.records if "Fancy_Policy_XYZ" in r.getMessage()]
    assert len(hits) == 1 and "fallback=greedy" in hits[0].getMessage()


def test_misspelled_section_suggests_the_section(tmp_path):
    """Regression: 'epl:' suggested the non-existent flag '--eplb'."""
    p = tmp_path / "c.yaml"
    p.write_text("epl:\n  ep_size: 4\n")
    with pytest.raises(ConfigError, match=r"c.yaml:1: unknown key 'epl' \(did you mean "
                                          r"section 'eplb'\?\)"):
        load("--config", str(p))
