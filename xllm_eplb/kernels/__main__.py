"""``python -m xllm_eplb.kernels``: build the fused CPU kernels (:mod:`.build`)."""

from xllm_eplb.kernels.build import main

raise SystemExit(main())
