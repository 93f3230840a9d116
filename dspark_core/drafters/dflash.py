"""DFlash drafter: DSpark's parallel backbone alone (markov_rank 0, no confidence head).

DeepSpec stores DFlash checkpoints with the same class as DSpark (`Qwen3DSparkModel`), so this is the
DSpark drafter restricted to that configuration: draft logits are the base logits U_k, every slot is
chosen independently, and proposals carry no confidences. Knows nothing about tokenization or gRPC.
"""

from __future__ import annotations

from dspark_core.drafters.base import DEFAULT_SUPPORT_SIZE
from dspark_core.drafters.config import DrafterConfig
from dspark_core.drafters.dspark import DSparkDrafter
from dspark_core.errors import InvalidArgument


class DFlashDrafter(DSparkDrafter):
    def __init__(self, config: DrafterConfig, support_size: int = DEFAULT_SUPPORT_SIZE, name: str | None = None):
        if config.kind != "dflash":
            raise InvalidArgument("markov_rank", config.markov_rank,
                                  "must be 0 with enable_confidence_head false for DFlash")
        super().__init__(config, support_size, name)
