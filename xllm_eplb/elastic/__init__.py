"""Elastic EP (``--elastic_ep``, on by default): a worker that dies, or stays silent for
``--elastic_silence_seconds``, is replaced while the run keeps serving.

One room, one file per role (docs/architecture.md, "Elastic EP: one death's recovery"):

* ``recovery.py``   the engine's state machine (``EngineRecovery``):
  detect -> fence -> re-form -> resume, and a rejoin's join -> switch (-> abandon);
  ``counters.py`` its counters and last records;
* ``supervisor.py`` the launcher's component (``ElasticSupervisor``):
  which mode a death gets (rejoin / respawn / shrink, and why), replacements, joiners, fencing;
  per worker a named state changed by one transition function;
* ``notices.py``    how the engine learns of a death: the typed notices launcher -> engine, the
  engine's one reader of them, and its silent-worker fence;
* ``protocol.py``   the membership conversation, one owner: every store key, the membership
  generation, the vote and its decision, the one store wait loop and the one answer loop;
* ``ports.py``      the typed ports: what recovery needs from the engine (``EnginePort``), what
  the supervisor asks of the launcher (``LauncherPort``).

A worker's component is ``worker/membership.py`` (``WorkerMembership``; the ``worker`` layer is
above this one); it speaks ``protocol.py`` too. Layer: below ``engine``/``worker``, above ``ipc``
(tests/test_imports.py).
"""
