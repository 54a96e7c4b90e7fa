"""The worker's model: a Hugging Face MoE checkpoint sharded by expert parallelism.

- ``decoder.Decoder``: one rank's model of a checkpoint, every family (``spec``, ``blocks``,
  ``attention``, ``rope``, ``loader``, ``params``, ``resolve``); ``step.StepResult``: one step's
  output, ``step.sample``: sampling;
- ``default_checkpoint``: the checkpoint generated from the config when ``--model`` is empty
  (``checkpoint*``: the generator behind ``xllm-eplb make-checkpoint``);
- ``moe.FusedMoE``: per-rank expert storage per physical slot (the EPLB migration contract);
- ``dispatch``: plain / overlapped all_to_all dispatch and the mode resolution of spec §9;
- ``routing``: top-k routers (the family's gate or a recorded load trace);
- ``batch``: ``SeqRow`` / ``RankBatch``.
"""
