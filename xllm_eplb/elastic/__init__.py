"""Elastic EP (``--elastic_ep``, on by default): a worker that dies, or stays silent for
``--elastic_silence_seconds``, is replaced while the run keeps serving.

One room, one file per role (docs/architecture.md, "Recovery of one death"):

* ``recovery.py``   the engine's state machine (:class:`~xllm_eplb.elastic.recovery.EngineRecovery`):
  detect -> fence -> re-form -> resume, and a rejoin's join -> switch (-> abandon);
* ``supervisor.py`` the launcher's component (:class:`~xllm_eplb.elastic.supervisor.ElasticSupervisor`):
  which mode a death gets (rejoin / respawn / shrink, and why), replacements, joiners, fencing;
  per worker a named state changed by one transition function;
* ``notices.py``    the typed notices launcher -> engine and the engine's one reader of them;
* ``regroup.py``    the one regroup step and the one wait loop every re-formation uses;
* ``protocol.py``   the shared constants and the owner of the membership generation.

What each process offers it: the engine ``Engine.resize(workers, placement)`` plus the few
port methods ``recovery.py`` lists; a worker ``worker/regroup.py`` (leave, join a generation,
vote); the launcher its ``spawn`` and ``death_message``. Layer: below ``engine``/``worker``, above
``ipc`` (tests/test_imports.py).
"""
