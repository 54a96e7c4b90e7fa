"""The worker's model: a small DeepSeek-style MoE decoder sharded by expert parallelism.

- ``transformer.MoETransformer`` / ``StepResult``: one rank's model and one step's output;
- ``moe.FusedMoE``: per-rank expert storage per physical slot (the EPLB migration contract);
- ``dispatch``: plain / overlapped all_to_all dispatch and the mode resolution of spec §9;
- ``routing``: top-k routers (model gate or recorded load trace);
- ``topics``: token topic clusters that make routing skewed (workload helpers);
- ``weights``: deterministic seeded weights, ``expert_weights(cfg, layer, e)``, weight files;
- ``batch``: ``SeqRow`` / ``RankBatch``.
"""
