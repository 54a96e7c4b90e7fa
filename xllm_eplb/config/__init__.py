"""The one typed, frozen configuration tree of xllm-eplb.

Every option is a dataclass field whose ``metadata`` (built by :func:`opt`) carries the help
text, unit, bounds and choices. That metadata drives flag parsing (``flags.py``), validation,
``xllm-eplb config show`` and the generated ``docs/configuration.md``.

Flag names are flat and unique across sections (gflags style): ``--enable_eplb``,
``--num_experts``, ``--port``. The section only groups them.

The package splits it by concern: ``fields.py`` (the sections and :class:`Config`),
``schema.py`` (the flag schema :data:`FIELDS`, formatting, policy kinds) and ``rules.py``
(validation, the backend, layout and topology rules). Import from ``xllm_eplb.config``.
"""

from xllm_eplb.config.fields import (
    Config,
    EplbConfig,
    FaultConfig,
    MiB,
    ModelConfig,
    RuntimeConfig,
    ServeConfig,
    opt,
)
from xllm_eplb.config.layout import elastic_redundancy_needed, rank_slots, survivors_hold_all
from xllm_eplb.config.rules import (
    BACKEND_FOR_DEVICE,
    DEVICES_FOR_BACKEND,
    check_field,
    elastic_rules,
    layout_error,
    layout_rules,
    node_of_rank,
    node_ranks,
    ranks_per_node,
    resolve_backend,
    topology_rules,
    validate,
)
from xllm_eplb.config.schema import (
    FIELDS,
    LEGACY_POLICY_KINDS,
    POLICY_KINDS,
    SECTIONS,
    FieldSpec,
    as_flat_dict,
    format_value,
    get_value,
    known_policy_kind,
    normalize_policy_kind,
)

__all__ = [
    "BACKEND_FOR_DEVICE", "DEVICES_FOR_BACKEND", "FIELDS", "LEGACY_POLICY_KINDS", "MiB",
    "POLICY_KINDS", "SECTIONS", "Config", "EplbConfig", "FaultConfig", "FieldSpec",
    "ModelConfig", "RuntimeConfig", "ServeConfig", "as_flat_dict", "check_field",
    "elastic_redundancy_needed", "elastic_rules", "format_value", "get_value",
    "known_policy_kind", "layout_error", "layout_rules", "node_of_rank", "node_ranks",
    "normalize_policy_kind", "opt", "rank_slots", "ranks_per_node", "resolve_backend",
    "survivors_hold_all", "topology_rules", "validate",
]
