"""This project's placement policies inside other engines (no host package is imported here).

- :mod:`.deepseek` -- DeepSeek EPLB's ``rebalance_experts`` signature and triple;
- :mod:`.vllm` -- ``XllmEplbPolicy`` (vLLM's ``AbstractEplbPolicy`` classmethod) and the
  ``vllm.general_plugins`` entry point ``register``;
- :mod:`.sglang` -- the ``sglang.srt.plugins`` entry point ``register`` (AROUND hook on
  ``sglang.srt.eplb.eplb_algorithms.rebalance_experts``);
- :mod:`.vllm_ascend` -- ``XllmAscendPolicy`` (vllm-ascend's legacy ``EplbPolicy``);
- :mod:`.formats` -- placement files for ``xllm-eplb plan --format`` and their read-back checks.

Opt-in: the entry points do nothing unless ``XLLM_EPLB_POLICY`` is set; ``XLLM_EPLB_STRICT=1``
makes every adapter raise instead of falling back to the host's policy (the two environment
variables the library reads). See docs/integrations.md.
"""
