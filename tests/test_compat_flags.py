"""Flags a vLLM or SGLang user reaches for: aliases with the same meaning, other engines'
features refused with a reason, ``--workload`` / ``--noworkload``, ``--ep-size 1``, an unknown
policy kind and model-size errors naming config.json (exit 2), ``--model ORG/NAME`` from the
local Hugging Face cache, ``--tokenizer`` / ``--chat-template`` checked before start, and the
API key never printed."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from xllm_eplb.cli import cli
from xllm_eplb.errors import ConfigError
from xllm_eplb.flags import load_config
from xllm_eplb.model.checkpoint import make_checkpoint
from xllm_eplb.model.hub_cache import cache_dir, is_repo_id


def load(*argv: str):
    return load_config(list(argv))


def _validate(*flags: str, env: dict | None = None):
    return CliRunner().invoke(cli, ["config", "validate", "--port", "0", *flags], env=env)


@pytest.fixture(scope="module")
def mixtral4(tmp_path_factory):
    """A 4-expert mixtral checkpoint (config.json: num_local_experts=4)."""
    return make_checkpoint("mixtral", tmp_path_factory.mktemp("mx") / "m", num_experts=4,
                           top_k=2)


def test_vllm_and_sglang_names_mean_our_fields(tmp_path):
    cfg, src = load("--ep-size", "2", "--max-model-len", "4096", "--max-num-seqs", "3",
                    "--chunked-prefill-size=128", "--served-model-name", "m")
    assert (cfg.model.max_position_embeddings, cfg.runtime.max_batch_size,
            cfg.runtime.max_prefill_tokens, cfg.serve.served_model_name) == (4096, 3, 128, "m")
    assert src["max_position_embeddings"] == "cli"
    p = tmp_path / "c.yaml"
    p.write_text("max_model_len: 300\nruntime:\n  max_num_seqs: 5\n")
    cfg, _ = load("--ep-size", "2", "--config", str(p))
    assert (cfg.model.max_position_embeddings, cfg.runtime.max_batch_size) == (300, 5)


@pytest.mark.parametrize("flag,why", [
    ("--tensor-parallel-size=2", "this engine has no tensor parallelism"),
    ("--pipeline-parallel-size=2", "this engine has no pipeline parallelism"),
    ("--gpu-memory-utilization=0.9", "this engine has no preallocated KV-cache pool"),
    ("--enable-prefix-caching", "this engine has no prefix caching"),
    ("--quantization=fp8", "this engine takes the quantization from the checkpoint"),
    ("--kv-cache-dtype=fp8", "this engine keeps the KV cache in the model's --dtype"),
    ("--enforce-eager", "this engine always runs eagerly"),
])
def test_other_engines_features_are_refused_with_the_reason(flag, why, tmp_path):
    with pytest.raises(ConfigError, match=f"{flag.split('=')[0]}: {why}"):
        load("--ep-size", "2", flag)
    p = tmp_path / "c.yaml"
    p.write_text("tensor_parallel_size: 2\n")
    with pytest.raises(ConfigError, match="c.yaml:1: key 'tensor_parallel_size': this engine"):
        load("--ep-size", "2", "--config", str(p))


def test_workload_reads_like_a_boolean(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("serve:\n  workload: synthetic\n")
    assert load("--ep-size", "2", "--config", str(p), "--noworkload")[0].serve.workload == "none"
    assert load("--ep-size", "2", "--no-workload")[0].serve.workload == "none"
    cfg, _ = load("--ep-size", "2", "--workload", "--port", "9")
    assert (cfg.serve.workload, cfg.serve.port) == ("synthetic", 9)
    assert load("--ep-size", "2", "--workload")[0].serve.workload == "synthetic"
    assert load("--ep-size", "2", "--workload", "none")[0].serve.workload == "none"
    with pytest.raises(ConfigError, match="--noworkload takes no value"):
        load("--ep-size", "2", "--noworkload=1")


def test_ep_size_one_is_the_single_rank_baseline():
    cfg, src = load("--ep-size", "1", "--config", "configs/eplb.yaml")   # EPLB on in the file
    assert (cfg.eplb.ep_size, cfg.eplb.enable_eplb, cfg.eplb.redundant_experts_num) == \
        (1, False, 0)
    assert src["enable_eplb"] == src["redundant_experts_num"] == "ep_size=1"
    assert cfg.slots_per_rank == cfg.model.num_experts
    with pytest.raises(ConfigError, match="--enable_eplb=true: needs --ep_size > 1"):
        load("--ep-size", "1", "--enable_eplb")
    with pytest.raises(ConfigError, match="--redundant_experts_num=2: must be 0 with"):
        load("--ep-size", "1", "--redundant_experts_num=2")
    with pytest.raises(ConfigError, match="--nnodes=2: must divide --ep_size=1"):
        load("--ep-size", "1", "--nnodes", "2", "--master_port", "29500")
    r = _validate("--ep-size", "1", "--config", "configs/eplb.yaml")
    assert r.exit_code == 0 and "ep_size=1" in r.output, r.output


def test_unknown_policy_kind_is_exit_2_in_config_validate():
    r = _validate("--ep-size", "4", "--eplb_policy_kind=foo")
    assert r.exit_code == 2 and "--eplb_policy_kind=foo: must be one of balanced" in r.output


def test_model_size_errors_name_config_json(mixtral4):
    r = _validate("--model", str(mixtral4), "--ep-size", "3")
    assert r.exit_code == 2, r.output
    assert f"{mixtral4}/config.json: num_local_experts=4 (routed experts per MoE layer): " \
           f"must be divisible by --ep_size=3" in r.output
    assert "--num_experts=64" not in r.output
    r = _validate("--model", str(mixtral4), "--ep-size", "2", "--redundant_experts_num=3")
    assert r.exit_code == 2 and "num_local_experts=4 in " in r.output, r.output
    r = _validate("--model", str(mixtral4), "--ep-size", "4", "--workload",
                  "--workload_prompt_len=2100")
    assert r.exit_code == 2 and "must be <= max_position_embeddings=2048 of " \
        f"{mixtral4}/config.json" in r.output, r.output
    assert _validate("--model", str(mixtral4), "--ep-size", "4").exit_code == 0


def test_model_org_name_resolves_in_the_local_hub_cache(mixtral4, tmp_path):
    hub = tmp_path / "hub"
    repo = hub / "models--acme--tiny-moe"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / "abc123").symlink_to(mixtral4, target_is_directory=True)
    (repo / "refs" / "main").write_text("abc123")
    r = _validate("--model", "acme/tiny-moe", "--ep-size", "4", env={"HF_HUB_CACHE": str(hub)})
    assert r.exit_code == 0, r.output
    r = _validate("--model", "acme/tiny-moe", "--ep-size", "4",
                  env={"HF_HUB_CACHE": "", "HF_HOME": str(tmp_path)})   # HF_HOME/hub
    assert r.exit_code == 0, r.output
    r = _validate("--model", "acme/other", "--ep-size", "4", env={"HF_HUB_CACHE": str(hub)})
    assert r.exit_code == 2 and "--model=acme/other: not a folder, and not in the local " \
        f"Hugging Face cache ({hub}/models--acme--other does not exist)" in r.output
    assert cache_dir({}).parts[-3:] == (".cache", "huggingface", "hub")
    assert cache_dir({"XDG_CACHE_HOME": "/x"}) == cache_dir({"HF_HOME": "/x/huggingface"})
    assert is_repo_id("Qwen/Qwen3-30B-A3B") and not is_repo_id("/abs/path")
    assert not is_repo_id("a/b/c") and not is_repo_id("configs/eplb.yaml")   # exists here


def test_tokenizer_and_chat_template_are_checked_before_start(mixtral4, tmp_path):
    r = _validate("--ep-size", "4", "--tokenizer", str(tmp_path / "none"))
    assert r.exit_code == 2 and "--tokenizer=" in r.output and "not a folder" in r.output
    r = _validate("--ep-size", "4", "--chat-template", "{% for m in messages %}")
    assert r.exit_code == 2 and "--chat_template: chat template does not compile" in r.output
    r = _validate("--ep-size", "4", "--chat-template", str(tmp_path / "t.jinja"))
    assert r.exit_code == 2 and "no such file" in r.output
    t = tmp_path / "t.jinja"
    t.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert _validate("--ep-size", "4", "--model", str(mixtral4), "--tokenizer", str(mixtral4),
                     "--chat-template", str(t)).exit_code == 0


def test_the_api_key_is_never_printed():
    r = CliRunner().invoke(cli, ["config", "show", "--ep-size", "2", "--api-key", "s3cret"])
    assert r.exit_code == 0 and "api_key=<set> (cli)" in r.output and "s3cret" not in r.output


def test_vllm_positional_model_is_model(mixtral4):
    # issue 41 item 4: `vllm serve MODEL`; config show/validate read it the same way
    cfg, src = load_config([str(mixtral4), "--ep-size", "4"], positional_model=True)
    assert cfg.model.model == str(mixtral4) and src["model"] == "cli"
    cfg, _ = load_config(["--ep-size", "4", "--enable_eplb", str(mixtral4)],
                         positional_model=True)
    assert cfg.model.model == str(mixtral4) and cfg.eplb.enable_eplb
    r = _validate(str(mixtral4), "--ep-size", "4")
    assert r.exit_code == 0 and f"model={mixtral4}" in r.output, r.output
    with pytest.raises(ConfigError, match="the model is already given as 'a'"):
        load_config(["a", "b", "--ep-size", "4"], positional_model=True)
    with pytest.raises(ConfigError, match="--model=b: the model is already given as the "
                                          "positional argument 'a'; give it once"):
        load_config(["a", "--model", "b", "--ep-size", "4"], positional_model=True)
    with pytest.raises(ConfigError, match="--model=b already names the model"):
        load_config(["--model", "b", "a", "--ep-size", "4"], positional_model=True)
    # commands without a model keep the flags-only rule
    with pytest.raises(ConfigError, match="unexpected argument 'a': flags look like"):
        load("a", "--ep-size", "4")


@pytest.mark.parametrize("argv,why", [
    (["-tp", "2"], "-tp: this engine has no tensor parallelism"),
    (["-pp=2"], "-pp: this engine has no pipeline parallelism"),
    (["-x"], "unexpected argument '-x': flags look like --name=value (two dashes"),
    (["--disable-log-requests"], "--disable-log-requests: this engine logs no request contents"),
    (["--eplb-config", "{}"], "--eplb-config: vLLM's JSON of EPLB settings has no single "
                              "counterpart: each setting is its own flag here: "
                              "--eplb_update_interval"),
    (["--disable-log-stats"], "--disable-log-stats: the stats line is --log_stats_interval"),
])
def test_vllm_short_and_logging_flags_get_a_reason_not_a_guess(argv, why):
    with pytest.raises(ConfigError) as e:
        load("--ep-size", "2", *argv)
    assert str(e.value).startswith(why) and "did you mean" not in str(e.value), str(e.value)


def test_seed_with_a_model_is_refused_with_the_reason(mixtral4):
    r = _validate("--model", str(mixtral4), "--ep-size", "4", "--seed", "1234")
    assert r.exit_code == 2 and (f"--seed=1234: seeds only the generated checkpoint's weights; "
                                 f"with --model={mixtral4} the weights are the checkpoint's") \
        in r.output, r.output
    assert load("--ep-size", "4", "--seed", "1234")[0].model.seed == 1234   # generated: fine
    assert load("--ep-size", "4", "--num-redundant-experts", "2")[0].eplb \
        .redundant_experts_num == 2                                        # vLLM's name


def test_the_model_string_is_served_as_a_name_too(mixtral4):
    from xllm_eplb.config.aliases import with_served_alias
    from xllm_eplb.engine.api import ApiLimits
    from xllm_eplb.engine.protocol import ServedModel
    from xllm_eplb.engine.tokenizer import ByteTokenizer

    cfg = with_served_alias(load("--model", str(mixtral4), "--ep-size", "4")[0])
    assert (cfg.serve.served_model_name, cfg.serve.served_model_alias) == ("xllm-eplb",
                                                                           str(mixtral4))
    assert with_served_alias(load("--ep-size", "4")[0]).serve.served_model_alias == ""
    cfg = with_served_alias(load("--model", str(mixtral4), "--ep-size", "4",
                                 "--served_model_alias", "qwen")[0])
    assert cfg.serve.served_model_alias == "qwen"
    s = ServedModel("xllm-eplb", ByteTokenizer(), ApiLimits(256, 8, 16), aliases=("/m/q",))
    assert s.serves("xllm-eplb") and s.serves("/m/q") and not s.serves("q")
    assert s.names == "'xllm-eplb' (or '/m/q')"


def test_config_commands_name_the_served_family_and_eplb_state(mixtral4):
    # issue 41 item 7: `config show --model <dir>` said model_arch=deepseek_v3 (default);
    # `config validate --ep-size 1` said policy=incremental (one rank has no EPLB)
    r = CliRunner().invoke(cli, ["config", "show", str(mixtral4), "--ep-size", "4"])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.lstrip().startswith("model_arch"))
    assert "mixtral" in line and f"checkpoint {mixtral4}" in line, line
    r = _validate("--ep-size", "1")
    assert r.exit_code == 0 and "(ep_size=1, eplb=off, model=generated deepseek_v3 (random " \
        "weights))" in r.output, r.output
