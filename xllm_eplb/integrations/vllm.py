"""vLLM: ``XllmEplbPolicy``, a drop-in for vLLM's ``AbstractEplbPolicy``, and the
``vllm.general_plugins`` entry point that installs it.

vLLM calls ``policy.rebalance_experts(weight [L, E], num_replicas, num_groups, num_nodes,
num_ranks, old_global_expert_indices)`` on the class (main thread, or a daemon thread with
async EPLB) and needs ``phy2log [L, num_replicas]`` int64 on the CPU. ``old_global_expert_indices``
is the previous physical->logical map ``[L, R_old]``: its retained experts keep their slots
(incremental moves only what the drift needs); a row with ``-1`` slots, or a map of another
width (elastic scale-down), is planned fresh.

vLLM's config accepts only ``policy="default"`` (``EPLBPolicyOption``), so :func:`register`
replaces ``vllm.distributed.eplb.policy.EPLB_POLICIES["default"]`` (the dict ``EplbState`` reads
at ``add_model``) -- only when ``XLLM_EPLB_POLICY`` is set; otherwise it does nothing. Plugins load
in every vLLM process; ``VLLM_PLUGINS`` filters them by entry-point name (``xllm_eplb``).
A failure logs one line and returns the replaced default policy's plan, when that policy plans
the layout (if it refuses too, our error is raised, naming the rule); with ``XLLM_EPLB_STRICT=1``
(or ``strict = True`` on the class) every failure raises.
"""

from __future__ import annotations

from xllm_eplb.integrations.core import STRICT_ENV, env_kind, log, plan_physical, strict_mode

__all__ = ["XllmEplbPolicy", "register"]


class XllmEplbPolicy:
    """vLLM's policy interface (a classmethod). ``kind``: the policy (None: ``XLLM_EPLB_POLICY``,
    else incremental); ``host_default``: vLLM's policy class this one replaced (the fallback);
    ``strict``: raise instead of falling back (None: ``XLLM_EPLB_STRICT``)."""

    _xllm_eplb = True
    kind: str | None = None
    host_default = None
    strict: bool | None = None

    @classmethod
    def rebalance_experts(cls, weight, num_replicas: int, num_groups: int, num_nodes: int,
                          num_ranks: int, old_global_expert_indices=None):
        """-> phy2log int64 CPU tensor [L, num_replicas] (see the module doc)."""
        try:
            import torch

            table = plan_physical(weight, num_replicas, num_ranks, kind=cls.kind,
                                  old=old_global_expert_indices, num_nodes=num_nodes,
                                  num_groups=num_groups)
            return torch.from_numpy(table)
        except Exception as e:
            if cls.host_default is None or strict_mode(cls.strict):
                raise
            ours = e
        name = getattr(cls.host_default, "__name__", "default")
        try:
            out = cls.host_default.rebalance_experts(weight, num_replicas, num_groups,
                                                     num_nodes, num_ranks,
                                                     old_global_expert_indices)
        except Exception:
            # the host refuses it too: our error names the rule (no "using vLLM's" line)
            raise ours from None
        log.warning("xllm-eplb: %s: %s; planned by vLLM's %s (set %s=1 to raise instead)",
                    type(ours).__name__, ours, name, STRICT_ENV)
        return out


def install(registry: dict, kind: str, abstract=None) -> type:
    """Replace ``registry["default"]`` by a subclass of :class:`XllmEplbPolicy` and of the
    replaced class (else of ``abstract``, vLLM's ``AbstractEplbPolicy``, when given) that falls
    back to the replaced class. Idempotent. Returns the installed class."""
    cur = registry.get("default")
    if getattr(cur, "_xllm_eplb", False):
        return cur
    # a subclass of the replaced class too: vLLM code calling its other class methods (e.g.
    # DefaultEplbPolicy.preserve_intragpu_slots) still finds them
    host = (cur,) if isinstance(cur, type) else ()
    bases = (XllmEplbPolicy,) + (host or ((abstract,) if abstract is not None else ()))
    cls = type("XllmEplbPolicy", bases, {"kind": kind, "host_default": cur,
                                         "__module__": __name__})
    registry["default"] = cls
    return cls


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install only when ``XLLM_EPLB_POLICY`` is set."""
    kind = env_kind()
    if kind is None:
        return
    try:
        from vllm.distributed.eplb import policy as vllm_policy
        from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy
    except Exception as e:                       # vLLM without EPLB policies: nothing to do
        log.warning("xllm-eplb: vLLM's EPLB policy registry is not importable (%s); vLLM keeps "
                    "its default policy", e)
        return
    install(vllm_policy.EPLB_POLICIES, kind, AbstractEplbPolicy)
    log.info("xllm-eplb: vLLM EPLB policy 'default' -> xllm-eplb %s", kind)
