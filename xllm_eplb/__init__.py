"""xllm-eplb: a multi-process MoE inference engine with live Expert Parallel Load Balancing."""

__version__ = "0.1.0"
