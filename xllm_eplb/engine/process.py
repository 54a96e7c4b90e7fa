"""The engine process around :class:`~xllm_eplb.engine.engine.Engine`: start-up in order (HTTP
bound, rings attached, warm-up, the EPLB manager, the synthetic workload; each stage reported
to the launcher), the step loop, and a teardown that leaves nothing behind (when the launcher
died, the engine sweeps the run's shm itself)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from xllm_eplb.child import (
    LAUNCHER_DEATHSIG,
    child_exit,
    child_setup,
    on_launcher_death,
    parent_alive,
    send_event,
)
from xllm_eplb.config import Config, ranks_per_node
from xllm_eplb.elastic.notices import NoticeBox, launcher_gone
from xllm_eplb.engine.backend import EngineApi
from xllm_eplb.engine.batch_rows import with_batch_rows
from xllm_eplb.engine.engine import Engine
from xllm_eplb.engine.failures import NOTICE_WAIT, SHUTDOWN, WorkerFault
from xllm_eplb.engine.workload import SyntheticWorkload
from xllm_eplb.ipc.objects import sweep_until_clean
from xllm_eplb.ipc.ring import InputRing, OutputRing
from xllm_eplb.obs.logs import FILE_ONLY, event, setup_logging

log = logging.getLogger(__name__)


def _attach_rings(cfg: Config):
    rid = cfg.runtime.run_id
    inp = InputRing.attach(rid, producer=True, timeout=30.0)
    outs = [OutputRing.attach(rid, r, reader=True, timeout=30.0) for r in range(cfg.eplb.ep_size)]
    return inp, outs


def _api(cfg: Config, engine_ref: dict):
    from xllm_eplb.engine.api import ApiBackend, ApiLimits, ApiServer, ServedModel
    from xllm_eplb.engine.record_api import record_router
    from xllm_eplb.engine.tokenizer import served_tokenizer
    from xllm_eplb.model.fp8 import quant_info
    from xllm_eplb.model.spec import parse_spec

    m = cfg.model
    limits = ApiLimits.served(m)
    # the checkpoint's tokenizer (--model, or the default the launcher generated without it)
    tok = served_tokenizer(m.model or None, cfg.serve.tokenizer, cfg.serve.chat_template)
    alias = cfg.serve.served_model_alias
    served = ServedModel(cfg.serve.served_model_name, tok, limits, created=int(time.time()),
                         quantization=quant_info(m.model, m.fp8_dequant_cache),
                         family=parse_spec(m.model).family if m.model else None,
                         aliases=(alias,) if alias and alias != cfg.serve.served_model_name
                         else ())

    def eng():          # the API's view of the engine once it runs (engine/backend.py)
        e = engine_ref.get("engine")
        return EngineApi(e) if e is not None else None

    def need():
        if eng() is None:
            raise RuntimeError("engine not started")
        return eng()

    backend = ApiBackend(
        submit=lambda r: need().submit(r),
        cancel=lambda rid, why: need().cancel(rid, why),
        status=lambda: eng().status() if eng() else {"status": "starting"},
        metrics=lambda: eng().render_metrics() if eng() else b"",
        health=lambda: eng().health() if eng() else (False, {"status": "starting"}),
        served=served,
        admit=lambda: need().admit(),
        routers=(record_router(lambda: getattr(engine_ref.get("engine"), "recorder", None)),),
        api_key=cfg.serve.api_key)
    return ApiServer(cfg.serve.host, cfg.serve.port, backend)


def _elastic(cfg: Config, eng: Engine, events):
    """``--elastic_ep``: the recovery state machine (``elastic/recovery.py``) with its store
    client; it asks the launcher to SIGKILL a worker silent for ``--elastic_silence_seconds``."""
    if not cfg.runtime.elastic_ep:
        return None
    from xllm_eplb.elastic.recovery import EngineRecovery
    from xllm_eplb.ipc.store import store_client

    rt = cfg.runtime
    store = store_client(rt.master_addr, rt.master_port, rt.elastic_join_timeout_seconds)
    return EngineRecovery(
        eng, eng.failures.box, store, num_experts=cfg.model.num_experts,
        slots=cfg.slots_per_rank, num_layers=cfg.num_moe_layers,
        silence_s=rt.elastic_silence_seconds, join_timeout_s=rt.elastic_join_timeout_seconds,
        metrics=eng.metrics, on_cpu=eng.tele.on_elastic,
        kill=lambda w: send_event(events, "engine", "kill", f"ep{w}"))


def _start_workload(cfg: Config, engine: Engine):
    if cfg.serve.workload != "synthetic":
        return None
    cap = 4 * cfg.eplb.ep_size * cfg.runtime.max_batch_size
    wl = SyntheticWorkload(cfg, engine.sched.submit,
                           backlog=lambda: sum(engine.sched.load().values()), max_backlog=cap)
    wl.start()
    return wl


def _serve(cfg: Config, events, parent_pid: int, res: dict, stop: dict) -> int:
    ref: dict = {}
    cfg, why = with_batch_rows(cfg)      # --max_batch_size bounded by the KV cache, once
    log.info(event("engine batch rows", rows=cfg.runtime.max_batch_size, why=why))
    try:
        res["api"] = api = _api(cfg, ref)
    except OSError as e:
        send_event(events, "engine", "error",
                   f"--port={cfg.serve.port}: cannot listen on {cfg.serve.host} ({e.strerror})")
        return 2
    api.start()
    send_event(events, "engine", "http_bound", str(api.port))
    inp, outs = _attach_rings(cfg)
    res["rings"] = [inp] + outs
    send_event(events, "engine", "rings")
    # the launcher's notices (deaths; elastic EP's replacements and joiners); a dead launcher
    # (its pid gone) is a death too, found between output slices
    box = NoticeBox(getattr(events, "notice", None), lambda: parent_alive(parent_pid),
                    parent_pid)
    res["engine"] = eng = ref["engine"] = Engine(cfg, inp, outs, box=box,
                                                 cores=host_cores(cfg, parent_pid))
    eng.warmup()
    signal.signal(signal.SIGTERM,
                  lambda signum, _f: _stop_on(signal.SIGTERM, eng, parent_pid, stop))
    on_launcher_death(lambda: _stop_on(LAUNCHER_DEATHSIG, eng, parent_pid, stop))
    if stop["early"]:           # a SIGTERM during the warm-up whose SystemExit was swallowed
        raise SystemExit(0)
    send_event(events, "engine", "warmup")
    membership = _elastic(cfg, eng, events)
    if membership is not None:
        eng.use_membership(membership)
    eng.use_manager(make_manager(cfg, eng.placement))
    res["manager"] = eng.manager
    res["workload"] = _start_workload(cfg, eng)
    send_event(events, "engine", "ready")
    log.info(event("engine ready", ep_size=cfg.eplb.ep_size, port=api.port,
                   eplb=cfg.eplb.enable_eplb, workload=cfg.serve.workload))
    eng.run()
    return 0


def make_manager(cfg: Config, placement):
    """The EPLB manager of ``cfg`` on the deployed ``placement`` (None with EPLB off); an elastic
    resize builds the next one (``eplb/membership_plan.resized_manager``)."""
    if not cfg.eplb.enable_eplb:
        return None
    from xllm_eplb.eplb.manager import EplbManager

    return EplbManager(cfg.eplb, cfg.num_moe_layers, cfg.model.num_experts, runner="thread",
                       initial=placement, expect_timings=True)


def host_cores(cfg: Config, launcher_pid: int) -> dict:
    """This node's cores (the launcher's CPU set) and processes (its EP ranks + the engine):
    ``shared`` when there are more processes than cores, so that ranks take turns on them and
    the wall clock measures their total work, not the slowest rank (``xllm-eplb bench``)."""
    try:
        cpus = len(os.sched_getaffinity(launcher_pid))
    except OSError:
        cpus = len(os.sched_getaffinity(0))
    procs = ranks_per_node(cfg) + 1
    return {"cpus": cpus, "processes": procs, "shared": procs > cpus}


def _teardown(res: dict, parent_pid: int, run_id: str, reason: str = SHUTDOWN) -> None:
    eng = res.get("engine")
    if eng is not None and eng.manager is not res.get("manager"):
        res["manager"] = eng.manager        # an elastic shrink rebuilt it
    for key in ("workload", "manager"):
        if res.get(key) is not None:
            with contextlib.suppress(Exception):
                res[key].close()
    if eng is not None:
        eng.request_stop()
        eng.sched.fail_all(reason)
        eng.shutdown_workers()
    if res.get("api") is not None:
        with contextlib.suppress(Exception):
            res["api"].close()
    for ring in res.get("rings", []):
        with contextlib.suppress(Exception):
            ring.close()
    if not parent_alive(parent_pid):
        # NOTE: the launcher owns the shm; when it died (SIGKILL) the engine sweeps for it.
        # NOTE: until nothing is left: workers killed with the launcher may still hold objects
        sweep_until_clean(run_id)


def engine_main(cfg: Config, events, parent_pid: int) -> None:
    """Process entry point (spawned by the launcher)."""
    # NOTE: the launcher's death (LAUNCHER_DEATHSIG) -> graceful stop, clients told the launcher
    # is gone, then sweep the run's shm; SIGTERM (the launcher's stop) -> graceful stop
    stop = {"early": False}
    res: dict = {}

    def early(*_args) -> None:          # a stop or the launcher's death before serving
        stop["early"] = True
        if res.get("engine") is not None:   # the warm-up's wait leaves at its next slice
            res["engine"].request_stop()
        _raise_exit()

    child_setup("xllm-eplb:engine", parent_pid, on_death=early)
    Path(cfg.serve.log_dir).mkdir(parents=True, exist_ok=True)
    setup_logging("engine", cfg.serve.v, str(Path(cfg.serve.log_dir) / "engine.log"))
    signal.signal(signal.SIGTERM, early)
    code, reason = 1, SHUTDOWN
    try:
        code = _serve(cfg, events, parent_pid, res, stop)
    except SystemExit as e:
        code = 0 if stop["early"] else int(e.code or 0)
    except WorkerFault as e:
        if stop["early"]:   # a stop during start-up: the launcher's SIGTERM ended the workers
            log.info(event("engine start-up stopped", why=str(e)))
            code = 0
        else:
            reason = _worker_fault(e, res, events)
    except Exception as e:  # noqa: BLE001
        log.exception(event("engine failed", error=repr(e)))
        send_event(events, "engine", "error", f"{type(e).__name__}: {e}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(LAUNCHER_DEATHSIG, signal.SIG_IGN)
        if reason == SHUTDOWN and not parent_alive(parent_pid):
            reason = launcher_gone(parent_pid).message
        _teardown(res, parent_pid, cfg.runtime.run_id, reason)
        log.info(event("engine exit", code=code, steps=getattr(res.get("engine"), "step_no", 0)))
        logging.shutdown()
    child_exit(code, events)


def _worker_fault(e: WorkerFault, res: dict, events) -> str:
    """A worker fault ends the engine: logged (file only) and reported to the launcher, which
    prints the one summary line; returns the reason its clients are told (which rank died, the
    launcher's notice, not the survivor's error)."""
    eng = res.get("engine")
    reason = (eng.failures.explain(e, wait=0.0 if eng.stopping else NOTICE_WAIT)
              if eng is not None else str(e))
    log.error(event("engine worker fault", error=str(e), reason=reason), extra=FILE_ONLY)
    send_event(events, "engine", "error", str(e))
    return reason


def _stop_on(sig: signal.Signals, eng: Engine, parent_pid: int, stop: dict) -> None:
    """SIGTERM (the launcher's stop) or :data:`LAUNCHER_DEATHSIG` (its death) while serving: a
    graceful stop. ``stop["signal"]``: the signal that asked for it (said once: a second one,
    the launcher's death after its SIGTERM or the death signal twice, changes nothing)."""
    if stop.get("signal"):
        return
    stop["signal"] = sig.name
    gone = not parent_alive(parent_pid)
    (log.warning if gone else log.info)(event("engine stop", signal=sig.name,
                                              launcher="gone" if gone else f"pid {parent_pid}"))
    eng.request_stop()


def _raise_exit():
    """SIGTERM before the step loop runs (start-up): leave at once, cleanly.

    NOTE: a SIGTERM that arrives while a ring wait blocks in ``posix_ipc``'s ``sem_timedwait``
    runs this handler, but posix_ipc then replaces its SystemExit with ``SignalError``, which the
    ring retries (the warm-up, waiting on the workers' outputs): the exit is lost. The handler
    also sets ``stop["early"]``, which ``_serve`` checks once the warm-up returns (issue 35)."""
    raise SystemExit(0)
