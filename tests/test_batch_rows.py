"""Rows per DP rank: ``--max_batch_size`` (default 256, vLLM's ``--max-num-seqs``) bounded by
what ``--kv_cache_bytes`` holds at the model's full length (``engine/batch_rows.py``)."""

from __future__ import annotations

from xllm_eplb.engine.batch_rows import batch_rows, kv_bytes_per_token, with_batch_rows
from xllm_eplb.flags import config_from_dict, load_config


def test_default_is_vllms_256_and_max_num_seqs_sets_it():
    cfg = config_from_dict({"ep_size": 2})
    assert cfg.runtime.max_batch_size == 256
    assert load_config(["--ep-size", "2", "--max-num-seqs", "12"])[0].runtime.max_batch_size \
        == 12


def test_the_kv_budget_lowers_the_rows_and_says_why(ds8_ckpt):
    cfg = config_from_dict({"ep_size": 2, "model": {"model": str(ds8_ckpt)}})
    per_tok = kv_bytes_per_token(cfg)
    # deepseek_v3 (MLA): the cache holds every head's decompressed key and value
    heads, kd, vd, layers = 4, 16 + 8, 16, 4
    assert per_tok == layers * heads * (kd + vd) * 4
    rows, why = batch_rows(cfg)
    assert rows == 256 and why == "max_batch_size=256"         # 4 GiB holds far more
    per_req = 2048 * per_tok
    small = config_from_dict({"ep_size": 2, "model": {"model": str(ds8_ckpt)},
                              "kv_cache_bytes": 10 * per_req + 1})
    rows, why = batch_rows(small)
    assert rows == 10
    assert why == (f"bounded by the KV cache: --kv_cache_bytes={10 * per_req + 1} holds 10 "
                   f"requests of max_position_embeddings=2048 at {per_req} bytes each "
                   f"(--max_batch_size=256 asked)")
    bounded, _ = with_batch_rows(small)
    assert bounded.runtime.max_batch_size == 10 and bounded.runtime.kv_cache_bytes == \
        small.runtime.kv_cache_bytes
    tiny = config_from_dict({"ep_size": 2, "model": {"model": str(ds8_ckpt)}, "kv_cache_bytes": 1})
    assert batch_rows(tiny)[0] == 1                             # never below one row
