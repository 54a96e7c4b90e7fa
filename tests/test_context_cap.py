"""`--max-model-len` / `--context-length` with `--model DIR` (issue 35 item 2): a smaller value
caps the served context (`config show`, the API's limits and a longer prompt's 400 agree), a
larger one than the checkpoint's is one error line."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from xllm_eplb.cli import cli
from xllm_eplb.engine.protocol import ApiError, ApiLimits, ServedModel, parse_completion
from xllm_eplb.engine.tokenizer import ByteTokenizer
from xllm_eplb.errors import ConfigError
from xllm_eplb.flags import load_config
from xllm_eplb.model.resolve import resolve_config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from xllm_eplb.model.checkpoint import make_checkpoint

    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("cap") / "c", num_experts=8,
                           top_k=2, max_position_embeddings=1024)


def _resolved(ckpt, *flags):
    cfg, _ = load_config(["--ep-size", "2", "--model", str(ckpt), *flags])
    return resolve_config(cfg)


@pytest.mark.parametrize("flag", ["--max-model-len", "--context-length"])
def test_a_smaller_context_caps_what_is_served(ckpt, flag):
    cfg = _resolved(ckpt, flag, "512")
    assert cfg.model.max_position_embeddings == 512
    assert resolve_config(cfg).model.max_position_embeddings == 512      # idempotent
    served = ServedModel("m", ByteTokenizer(), ApiLimits.served(cfg.model))
    parse_completion({"prompt": [1] * 500, "max_tokens": 12}, served)
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": [1] * 600, "max_tokens": 4}, served)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert "600 tokens" in e.value.message and "512" in e.value.message
    out = CliRunner().invoke(cli, ["config", "show", "--model", str(ckpt), flag, "512"])
    assert out.exit_code == 0 and "max_position_embeddings=512 (cli)" in out.output


def test_without_the_flag_the_checkpoint_length_is_served_and_shown(ckpt):
    assert _resolved(ckpt).model.max_position_embeddings == 1024
    out = CliRunner().invoke(cli, ["config", "show", "--model", str(ckpt)])
    assert f"max_position_embeddings=1024 (checkpoint {ckpt})" in out.output, out.output


def test_a_larger_context_than_the_checkpoint_is_refused(ckpt):
    with pytest.raises(ConfigError, match=r"--max_position_embeddings=4096 \(--max-model-len, "
                       r"--context-length\): must be <= the checkpoint's "
                       r"max_position_embeddings=1024"):
        _resolved(ckpt, "--max-model-len", "4096")
    out = CliRunner().invoke(cli, ["config", "validate", "--ep-size", "2", "--model", str(ckpt),
                                   "--max-model-len", "4096"])
    assert out.exit_code == 2 and out.output.count("\n") == 1 and "error:" in out.output
