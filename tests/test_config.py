"""Schema metadata, per-field and cross-field validation, policy-kind normalisation."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from xllm_eplb.config import (
    FIELDS,
    LEGACY_POLICY_KINDS,
    POLICY_KINDS,
    SECTIONS,
    Config,
    EplbConfig,
    ServeConfig,
    as_flat_dict,
    format_value,
    normalize_policy_kind,
    validate,
)
from xllm_eplb.errors import ConfigError
from xllm_eplb.flags import config_from_dict, load_config


def check(**values) -> Config:
    """Validate a config built from flat values (ep_size defaults to 16)."""
    values.setdefault("ep_size", 16)
    return config_from_dict(values, require_ep_size=True)


def test_flag_names_are_unique_and_cover_every_field():
    n = sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    assert len(FIELDS) == n
    assert {f.section for f in FIELDS.values()} == set(SECTIONS)
    assert all(f.type in ("bool", "int", "float", "str", "tuple") for f in FIELDS.values())


def test_defaults_other_than_ep_size_are_valid():
    cfg = Config(eplb=EplbConfig(ep_size=16))
    assert validate(cfg) is cfg
    with pytest.raises(ConfigError, match="--ep_size is required"):
        validate(Config())
    validate(Config(), require_ep_size=False)


def test_spec_section_11_defaults():
    e = EplbConfig()
    # this project's defaults (spec section 11): EPLB on, incremental (xLLM: off, balanced)
    assert (e.enable_eplb, e.redundant_experts_num, e.eplb_update_interval) == (True, 1, 1000)
    assert (e.eplb_min_peak_load_improvement, e.eplb_policy_kind) == (0.05, "incremental")
    assert e.eplb_plan_on == "cost" and ServeConfig().workload == "none"
    assert (e.eplb_use_decode_only_load, e.eplb_prepare_timeout_seconds) == (False, 30)
    assert (e.expert_parallel_degree, e.enable_fused_mc2) == (0, -1)


@pytest.mark.parametrize("name,value,msg", [
    ("eplb_min_peak_load_improvement", 1.5, "--eplb_min_peak_load_improvement=1.5: must be in [0, 1]"),
    ("eplb_min_peak_load_improvement", -0.1, "must be in [0, 1]"),
    ("ep_size", 0, "--ep_size=0: must be >= 1"),
    ("ep_size", -2, "--ep_size=-2: must be >= 1"),
    ("redundant_experts_num", -1, "--redundant_experts_num=-1: must be >= 0"),
    ("eplb_update_interval", -1, "--eplb_update_interval=-1: must be >= 0"),
    ("eplb_prepare_timeout_seconds", 0, "--eplb_prepare_timeout_seconds=0: must be > 0"),
    ("enable_fused_mc2", 3, "--enable_fused_mc2=3: must be one of -1, 0, 1, 2"),
    ("enable_fused_mc2", -2, "must be one of -1, 0, 1, 2"),
    ("expert_parallel_degree", 3, "--expert_parallel_degree=3: must be one of 0, 1, 2"),
    ("eplb_estimator_decay", 0, "--eplb_estimator_decay=0: must be in (0, 1]"),
    ("eplb_estimator_decay", 1.01, "must be in (0, 1]"),
    ("port", 70000, "--port=70000: must be in [0, 65535]"),
    ("vocab_size", 100, "--vocab_size=100: must be >= 261"),
    ("device", "tpu", "--device=tpu: must be one of cpu, cuda, npu"),
    ("v", "loud", "--v=loud: must be one of debug, info, warning, error"),
    ("workload_rate", 0, "--workload_rate=0: must be > 0"),
])
def test_field_rules(name, value, msg):
    with pytest.raises(ConfigError) as e:
        check(**{name: value})
    assert msg in str(e.value)


@pytest.mark.parametrize("name,value", [
    ("eplb_min_peak_load_improvement", 0), ("eplb_min_peak_load_improvement", 1),
    ("eplb_estimator_decay", 1), ("eplb_update_interval", 0), ("eplb_update_interval", 0.5),
    ("ep_size", 2), ("enable_fused_mc2", -1), ("enable_fused_mc2", 2), ("port", 0),
    ("port", 65535), ("expert_parallel_degree", 2),
])
def test_closed_bounds_accept_edges(name, value):
    assert as_flat_dict(check(**{name: value}))[name] == value


@pytest.mark.parametrize("values,msg", [
    ({"ep_size": 12}, "--num_experts=64: must be divisible by --ep_size=12"),
    ({"num_experts_per_tok": 65}, "--num_experts_per_tok=65: must be <= --num_experts=64"),
    ({"hidden_size": 66}, "--hidden_size=66: must be divisible by --num_attention_heads=4"),
    ({"first_k_dense_replace": 4}, "--first_k_dense_replace=4: must be < --num_layers=4"),
    ({"eplb_num_nodes": 3}, "--eplb_num_nodes=3: must divide --ep_size=16"),
    ({"redundant_experts_num": 61}, "--redundant_experts_num=61: must be <= 60"),
    ({"routing_mode": "trace"}, "--routing_trace=\"\": required when --routing_mode=trace"),
    ({"eplb_p2p_chunk_bytes": 10, "eplb_p2p_max_inflight_bytes": 5},
     "--eplb_p2p_max_inflight_bytes=5: must be >= --eplb_p2p_chunk_bytes=10"),
    ({"backend": "nccl"}, "--backend=nccl: needs --device=cuda"),
    ({"backend": "hccl", "device": "cuda"}, "--backend=hccl: needs --device=npu"),
    ({"workload": "synthetic", "max_position_embeddings": 64},
     "--workload_prompt_len + --workload_output_len must be <= --max_position_embeddings=64"),
])
def test_cross_field_rules(values, msg):
    with pytest.raises(ConfigError) as e:
        check(**values)
    assert msg in str(e.value)


def test_cross_field_rules_accept_valid_combinations():
    c = check(ep_size=4, num_experts=8, eplb_num_nodes=2, redundant_experts_num=6,
              num_experts_per_tok=8, first_k_dense_replace=3, routing_mode="trace",
              routing_trace="t.npz", backend="gloo", workload="synthetic")
    assert c.slots_per_rank == 8 and c.num_moe_layers == 1


def test_ep_size_rules_skipped_when_not_required():
    c, src = load_config(["--num_experts=7"], require_ep_size=False)
    assert c.eplb.ep_size is None and src["ep_size"] == "default"


@pytest.mark.parametrize("kind", POLICY_KINDS)
def test_policy_kinds_case_insensitive(kind):
    assert normalize_policy_kind(kind.upper()) == kind
    assert normalize_policy_kind(f"  {kind.title()} ") == kind


@pytest.mark.parametrize("legacy", LEGACY_POLICY_KINDS)
def test_legacy_policy_names_map_to_balanced(legacy):
    assert normalize_policy_kind(legacy) == "balanced"
    assert normalize_policy_kind(legacy.upper()) == "balanced"


def test_unknown_policy_kind_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="xllm_eplb.config"):
        assert normalize_policy_kind("Balancd_Typo_123") == "greedy"
        assert normalize_policy_kind("Balancd_Typo_123") == "greedy"
        assert normalize_policy_kind("") == "greedy"
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("Balancd_Typo_123" in m for m in msgs) == 1


def test_rule_texts():
    assert FIELDS["eplb_min_peak_load_improvement"].rule() == "in [0, 1]"
    assert FIELDS["eplb_estimator_decay"].rule() == "in (0, 1]"
    assert FIELDS["ep_size"].rule() == ">= 1"
    assert FIELDS["redundant_experts_num"].rule() == ">= 0"
    assert FIELDS["enable_fused_mc2"].rule() == "one of -1, 0, 1, 2"
    assert FIELDS["enable_eplb"].rule() == ""


def test_format_value():
    assert [format_value(v) for v in (True, False, None, 0.05, 1000.0, 16, "", "x")] == \
        ["true", "false", "none", "0.05", "1000", "16", '""', "x"]
