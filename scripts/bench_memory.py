#!/usr/bin/env python3
"""Peak RSS of a rank loading a checkpoint whose experts are >= 80% of its bytes.

A deepseek_v3 checkpoint with wide experts (``make_checkpoint``: hidden 256, 32 experts of width
1024, 4 layers, 1 dense; routed experts ~96% of the bytes) is served with
``xllm-eplb serve --model DIR --ep-size EP`` (EPLB off, then on). Once the server is ready
(every rank has loaded), each worker's peak RSS (``VmHWM`` of ``/proc/PID/status``) is compared
with the budget of issue 12::

    1.3 x (non-expert weight bytes + its slots' expert bytes) + process baseline

- non-expert bytes: every tensor of the file that is not a routed expert (each rank holds the
  embedding, attention, norms, dense and shared MLPs, routers and LM head);
- slots' expert bytes: ``(E / EP + redundant) * MoE layers * bytes of one expert``;
- process baseline: what a rank costs without weights: the peak RSS of the ranks of the same
  ``serve`` (same EP size, same flags, one real request) on a tiny checkpoint of the same family
  (hidden 64, ~1 MiB of weights per rank), minus that rank's own weight bytes. It holds the
  torch runtime, the worker stack, the shared-memory rings it touched, the EP gloo group and
  the CPU kernels' first-use buffers. Also reported: ``import_baseline``, a process that only
  imports the stack and joins a one-rank gloo group (``--baseline``), a lower bound.

The KV cache is preallocated per rank; the run keeps it small (``--max_batch_size=1``,
``max_position_embeddings`` 256) and reports its size. With EPLB on, the staging buffers of
live migration are extra and shown in the same table. Also reported: the whole file's bytes, so
"no rank holds the whole model" is visible.

    python scripts/bench_memory.py [--quick] [--json PATH] [--ep 4]
    python scripts/bench_memory.py --quant fp8 [--quick] [--json PATH] [--ep 2]

``--quant fp8`` (issue 24): the same model twice, as a bf16 checkpoint and as an FP8
block-scaled one (``make_checkpoint(quant="fp8")``, 128 x 128 blocks, f32 scales, experts
>= 80 % of the file), both served in bf16 (EPLB off, per-step dequantization). A rank's expert
memory must be its slots' fp8 bytes + scale bytes (within 5 %). Measured two ways:

- reported: the worker's ``expert slots`` log line (the nbytes of its slot tensors) against the
  fp8 + scale bytes of its slots in the file;
- resident RSS: ``VmRSS`` of each worker once ready (loaded, before any request). The two runs
  differ only in expert storage, so ``bf16 slot bytes - (RSS_bf16 - RSS_fp8)`` is the memory
  the fp8 slots take, compared with their fp8 + scale bytes. ``VmHWM`` after one request is
  reported too: it adds the per-step dequantization of the step's active experts. Both
  servers run with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc): freed large blocks are returned,
  so the RSS is live memory rather than what the allocator kept after the warm-up step.

Needs the HF-checkpoint engine (``--model``).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from xllm_eplb.model.checkpoint import make_checkpoint  # noqa: E402
from xllm_eplb.testing.serving import Server, engine_serves_checkpoints, write_json  # noqa: E402

SIZES = dict(hidden_size=256, num_experts=32, top_k=2, moe_intermediate_size=1024,
             intermediate_size=512, num_layers=4, max_position_embeddings=256)
QUICK_SIZES = dict(SIZES, moe_intermediate_size=512, num_experts=16)
#: the weightless stand-in of the process baseline: same family, layers and experts, tiny widths
BASE_SIZES = dict(hidden_size=64, top_k=2, moe_intermediate_size=16, intermediate_size=32,
                  num_layers=4, max_position_embeddings=256)


def vm_hwm(pid: int) -> int:
    """Peak resident set of a process, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def baseline_child() -> None:
    """Import what a worker imports, join a one-rank gloo group, print the peak RSS."""
    import os

    import torch
    import torch.distributed as dist

    import xllm_eplb.model.decoder  # noqa: F401
    import xllm_eplb.worker.worker  # noqa: F401
    from xllm_eplb.testing.dist import free_port

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    dist.barrier()
    print(vm_hwm(os.getpid()))
    dist.destroy_process_group()


def file_bytes(model_dir: Path) -> tuple[int, int, dict]:
    """(non-expert bytes, total bytes, one expert's bytes per MoE layer)."""
    from safetensors import safe_open

    sizes = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "F8_E4M3": 1}
    total = expert = 0
    per_expert: dict[int, int] = {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():
            s = f.get_slice(k)
            n = math.prod(s.get_shape()) * sizes[s.get_dtype()]
            total += n
            if ".experts." in k:
                expert += n
                if ".experts.0." in k:
                    layer = int(k.split(".")[2])
                    per_expert[layer] = per_expert.get(layer, 0) + n
    return total - expert, total, per_expert


def rank_weight_bytes(model_dir: Path, ep: int, redundant: int,
                      num_experts: int) -> tuple[int, int, int]:
    """(non-expert bytes, one rank's slot expert bytes, file bytes) of a checkpoint."""
    non_expert, total, per_expert = file_bytes(model_dir)
    slots = num_experts // ep + redundant
    return non_expert, slots * sum(per_expert.values()), total


def rank_baseline(tmp: Path, ep: int, redundant: int, num_experts: int) -> int:
    """Peak RSS of a rank serving a tiny checkpoint, minus that rank's weights (bytes)."""
    base_dir = make_checkpoint("deepseek_v3", tmp / "base", num_experts=num_experts,
                               **BASE_SIZES)
    non_expert, slot_bytes, _ = rank_weight_bytes(base_dir, ep, redundant, num_experts)
    peaks = measure(base_dir, ep, False, tmp / "logs-base")
    return max(peaks) - (non_expert + slot_bytes)


def vm_rss(pid: int) -> int:
    """Current resident set of a process, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def measure(model_dir: Path, ep: int, eplb: bool, log_dir: Path, *, dtype: str = "float32",
            resident: list | None = None) -> list[int]:
    """Peak RSS of every worker after one request; ``resident`` gets their RSS once ready."""
    flags = [f"--dtype={dtype}", "--max_batch_size=1", "--max_prefill_tokens=64",
             f"--enable_eplb={'true' if eplb else 'false'}", "--eplb_update_interval=1000",
             "--eplb_first_round_samples=0"]
    srv = Server.start(model_dir, log_dir, flags, ep=ep)
    try:
        if resident is not None:
            resident.extend(vm_rss(pid) for pid in sorted(srv.worker_pids()))
        srv.complete([1, 2, 3, 4], 4)                       # one real request through every rank
        return [vm_hwm(pid) for pid in sorted(srv.worker_pids())]
    finally:
        srv.stop()


FP8_SIZES = dict(hidden_size=1024, num_experts=16, top_k=2, moe_intermediate_size=2048,
                 intermediate_size=512, num_layers=4, max_position_embeddings=256)
FP8_QUICK_SIZES = dict(FP8_SIZES, hidden_size=512, moe_intermediate_size=1024)


def reported_slots(log_dir: Path) -> list[dict]:
    """The ``expert slots`` log line of every worker (rank order)."""
    import re

    rows = []
    for f in sorted(log_dir.rglob("*.log")):
        for line in f.read_text().splitlines():
            if "expert slots" in line:
                rows.append({k: (int(v) if v.isdigit() else v)
                             for k, v in re.findall(r"(\w+)=(\S+)", line.split("expert slots")[1])})
    return sorted(rows, key=lambda r: r["rank"])


def fp8_main(args) -> int:
    """``--quant fp8``: see the module docstring."""
    sizes = FP8_QUICK_SIZES if args.quick else FP8_SIZES
    mib = 1 << 20
    # both servers: a fixed glibc mmap threshold, so freed large blocks (the per-step
    # dequantization's) go back to the system and resident RSS is live memory, not what the
    # allocator kept after the warm-up step
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    with tempfile.TemporaryDirectory(prefix="bench_memory_fp8_") as tmp:
        dirs = {"bf16": make_checkpoint("deepseek_v3", Path(tmp) / "bf16", dtype="bfloat16",
                                        **sizes),
                "fp8": make_checkpoint("deepseek_v3", Path(tmp) / "fp8", dtype="bfloat16",
                                       quant="fp8", block_size=128, **sizes)}
        files = {k: file_bytes(d) for k, d in dirs.items()}
        slots = sizes["num_experts"] // args.ep + args.redundant
        slot_file = {k: slots * sum(f[2].values()) for k, f in files.items()}
        resident, peak, reported = {}, {}, {}
        for k, d in dirs.items():
            resident[k] = []
            peak[k] = measure(d, args.ep, False, Path(tmp) / f"logs-{k}", dtype="bfloat16",
                              resident=resident[k])
            reported[k] = reported_slots(Path(tmp) / f"logs-{k}")
    non_expert, total, _ = files["fp8"]
    rss_fp8 = [slot_file["bf16"] - (b - f) for b, f in zip(resident["bf16"], resident["fp8"],
                                                             strict=True)]
    want = slot_file["fp8"]                 # fp8 bytes + f32 scale bytes of the rank's slots
    out = {"sizes": sizes, "ep": args.ep, "slots_per_rank": slots, "file_bytes": total,
           "expert_share_of_file": 1 - non_expert / total,
           "rank_slot_bytes_in_file": slot_file, "reported": reported,
           "reported_over_file": [r["bytes"] / want for r in reported["fp8"]],
           "resident_rss_bytes": resident, "peak_rss_bytes": peak,
           "rss_expert_bytes_fp8": rss_fp8, "rss_over_file": [b / want for b in rss_fp8]}
    out["within_5pct"] = all(abs(x - 1) <= 0.05 for x in out["reported_over_file"]
                             + out["rss_over_file"])
    print(f"FP8 file {total / mib:.1f} MiB (experts incl. scales "
          f"{100 * out['expert_share_of_file']:.1f}%); a rank's {slots} slots x "
          f"{len(files['fp8'][2])} layers: fp8+scales {want / mib:.2f} MiB, bf16 "
          f"{slot_file['bf16'] / mib:.2f} MiB")
    for r, fr, q in zip(reported["fp8"], out["rss_over_file"], rss_fp8, strict=True):
        print(f"rank {r['rank']}: reported slots {r['bytes'] / mib:.2f} MiB (fp8 "
              f"{r['fp8_bytes'] / mib:.2f} + scales {r['scale_bytes'] / 1024:.1f} KiB) = "
              f"{r['bytes'] / want:.4f} x file; resident RSS difference -> {q / mib:.2f} MiB = "
              f"{fr:.3f} x file")
    print("resident RSS MiB bf16", [round(x / mib, 1) for x in resident["bf16"]], "fp8",
          [round(x / mib, 1) for x in resident["fp8"]], "; peak after one request bf16",
          [round(x / mib, 1) for x in peak["bf16"]], "fp8",
          [round(x / mib, 1) for x in peak["fp8"]])
    print("within 5%:", out["within_5pct"])
    write_json(args.json, out)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="narrower experts, EPLB off only")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=1, help="redundant slots per rank (the "
                    "engine's default redundant_experts_num)")
    ap.add_argument("--quant", choices=["none", "fp8"], default="none",
                    help="fp8: an FP8 checkpoint's expert memory against fp8 + scale bytes")
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline:
        baseline_child()
        return 0
    if not engine_serves_checkpoints():
        print("skipped: this checkout has no --model (HF-checkpoint engine)")
        return 0
    if args.quant == "fp8":
        return fp8_main(args)
    sizes = QUICK_SIZES if args.quick else SIZES
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        model_dir = make_checkpoint("deepseek_v3", Path(tmp) / "ckpt", **sizes)
        non_expert, total, per_expert = file_bytes(model_dir)
        slots = sizes["num_experts"] // args.ep + args.redundant
        slot_bytes = slots * sum(per_expert.values())
        import_base = int(subprocess.run([sys.executable, __file__, "--baseline"], check=True,
                                         capture_output=True, text=True).stdout.split()[-1])
        base = rank_baseline(Path(tmp), args.ep, args.redundant, sizes["num_experts"])
        budget = 1.3 * (non_expert + slot_bytes) + base
        rows = []
        for eplb in ([False] if args.quick else [False, True]):
            peaks = measure(model_dir, args.ep, eplb, Path(tmp) / f"logs-{eplb}")
            rows.append({"eplb": eplb, "peak_rss_bytes": peaks, "max_peak": max(peaks),
                         "max_peak_over_budget": max(peaks) / budget,
                         "within_budget": max(peaks) <= budget,
                         "max_peak_over_import_budget":
                             max(peaks) / (1.3 * (non_expert + slot_bytes) + import_base)})
    mib = 1 << 20
    out = {"sizes": sizes, "ep": args.ep, "slots_per_rank": slots, "file_bytes": total,
           "expert_share_of_file": 1 - non_expert / total, "non_expert_bytes": non_expert,
           "slot_expert_bytes": slot_bytes, "baseline_bytes": base,
           "import_baseline_bytes": import_base, "budget_bytes": budget,
           "budget_with_import_baseline_bytes": 1.3 * (non_expert + slot_bytes) + import_base,
           "runs": rows}
    print(f"file {total / mib:.1f} MiB (experts {100 * out['expert_share_of_file']:.1f}%); "
          f"rank: non-expert {non_expert / mib:.1f} MiB + {slots} slots x "
          f"{len(per_expert)} layers = {slot_bytes / mib:.1f} MiB; baseline {base / mib:.1f} MiB "
          f"(import-only {import_base / mib:.1f} MiB);"
          f" budget 1.3 x weights + baseline = {budget / mib:.1f} MiB")
    for r in rows:
        print(f"EPLB {'on ' if r['eplb'] else 'off'}: peak RSS per rank "
              f"{[round(p / mib, 1) for p in r['peak_rss_bytes']]} MiB; max / budget = "
              f"{r['max_peak_over_budget']:.2f} ({'within' if r['within_budget'] else 'OVER'}); "
              f"over the import-only budget {r['max_peak_over_import_budget']:.2f}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
