"""The typed ports of elastic EP (``elastic/ports.py``, ``worker/membership.WorkerHost``) say
what the real classes offer: every member of a port exists on the real class (a method with
the same parameter names, a property, or an attribute its ``__init__`` sets), and on the
tests' fakes that stand in for it. A renamed or dropped engine method fails here, not in a
multi-process run."""

from __future__ import annotations

import inspect
import re
import typing

import pytest
import test_elastic_recovery
import test_elastic_supervisor

from xllm_eplb.elastic.ports import EnginePort, LauncherPort
from xllm_eplb.elastic.recovery import EngineRecovery
from xllm_eplb.elastic.supervisor import ElasticSupervisor
from xllm_eplb.engine.engine import Engine
from xllm_eplb.engine.membership import MembershipPort, NoMembership
from xllm_eplb.launcher.launcher import Launcher
from xllm_eplb.node.launcher import NodeLauncher
from xllm_eplb.worker.membership import WorkerHost, WorkerMembership
from xllm_eplb.worker.worker import Worker


def port_members(port) -> dict[str, inspect.Signature | None]:
    """name -> signature (methods) or None (attributes and properties) of a Protocol class."""
    out: dict[str, inspect.Signature | None] = dict.fromkeys(typing.get_type_hints(port))
    for name, member in vars(port).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            out[name] = None
        elif inspect.isfunction(member):
            out[name] = inspect.signature(member)
    return out


def _params(sig: inspect.Signature) -> list[str]:
    return [p for p in sig.parameters if p != "self"]


def missing_on_class(port, cls) -> list[str]:
    """Members of ``port`` the real class lacks, or whose parameters differ by name."""
    init = inspect.getsource(cls.__init__) if "__init__" in vars(cls) else ""
    bad = []
    for name, sig in port_members(port).items():
        member = inspect.getattr_static(cls, name, None)
        if sig is None:
            if member is None and f"self.{name} " not in init and f"self.{name}," not in init:
                bad.append(name)
        elif not callable(member) or _params(inspect.signature(member)) != _params(sig):
            bad.append(f"{name}{_params(sig)}")
    return bad


def missing_on_fake(port, fake) -> list[str]:
    """Members of ``port`` the fake instance lacks, or whose parameters differ by name."""
    bad = []
    for name, sig in port_members(port).items():
        if not hasattr(fake, name):
            bad.append(name)
        elif sig is not None and _params(inspect.signature(getattr(fake, name))) != _params(sig):
            bad.append(f"{name}{_params(sig)}")
    return bad


def used_through(cls, *receivers: str) -> set[str]:
    """The attribute names ``cls``'s source reaches through ``receiver.<name>``."""
    src = inspect.getsource(cls)
    return {m.group(1) for r in receivers for m in re.finditer(rf"\b{r}\.(\w+)", src)}


def test_the_ports_name_what_their_users_call():
    """Every member recovery / the supervisor / the worker's membership reach through their
    port is in the port (a reach past the port would show as a name not listed)."""
    used = used_through(EngineRecovery, "eng")
    assert used and used <= set(port_members(EnginePort)), used - set(port_members(EnginePort))
    used = used_through(ElasticSupervisor, "launcher", "la")
    assert used and used <= set(port_members(LauncherPort)), used - set(port_members(LauncherPort))
    used = used_through(Engine, r"self\.membership")
    assert used and used <= set(port_members(MembershipPort)), used - set(port_members(MembershipPort))
    used = used_through(WorkerMembership, "host")
    assert used and used <= set(port_members(WorkerHost)), used - set(port_members(WorkerHost))


@pytest.mark.parametrize("port,cls", [(EnginePort, Engine), (LauncherPort, Launcher),
                                      (LauncherPort, NodeLauncher), (WorkerHost, Worker),
                                      (MembershipPort, EngineRecovery),
                                      (MembershipPort, NoMembership)])
def test_the_real_classes_offer_their_port(port, cls):
    assert missing_on_class(port, cls) == []


def test_the_fakes_offer_their_port():
    assert missing_on_fake(EnginePort, test_elastic_recovery.FakeEngine()) == []
    fake = test_elastic_supervisor.FakeLauncher({}, test_elastic_supervisor.Events(), None)
    assert missing_on_fake(LauncherPort, fake) == []


def test_a_drifted_port_is_caught():
    """The check itself fails on a renamed method and on a changed parameter."""

    class Renamed:
        def __init__(self):
            self.step_no, self.stopping = 0, False

        def end_void_step(self, rank):          # the old docstring's name for void_step
            return 0, 0

    assert "void_step['rank']" in missing_on_class(EnginePort, Renamed)

    class Changed(test_elastic_recovery.FakeEngine):
        def read_output(self, worker, timeout):   # noqa: D102 - a worker id, not a rank
            return None

    assert missing_on_fake(EnginePort, Changed()) == ["read_output['rank', 'timeout']"]
