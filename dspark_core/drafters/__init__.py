"""Drafters: DSpark (parallel backbone + Markov head + confidence head), DFlash and Eagle3.

The engine talks to every drafter through `Drafter.new_state()` and the batched
`Drafter.propose(list[ProposeItem]) -> list[Proposal]` (see `base.py`). Checkpoints are DeepSpec-format
folders read by `load_drafter` and written by `save_drafter`. Drafters know nothing about tokenization,
gRPC, verification or scheduling.
"""

from dspark_core.drafters.base import Drafter, Proposal, ProposeItem
from dspark_core.drafters.checkpoint import build_drafter, load_drafter, save_drafter
from dspark_core.drafters.config import DrafterConfig, load_config

__all__ = [
    "Drafter", "DrafterConfig", "Proposal", "ProposeItem", "build_drafter", "load_config", "load_drafter",
    "save_drafter",
]
