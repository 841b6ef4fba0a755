"""The optimizer interface shared by techniques that wrap the real optimizer (fused-step,
offload:optimizer): the Trainer, the GradScaler, LR schedulers (attach them to ``.optimizer``) and the
MemoryTracker see the wrapped optimizer's groups, state and state dict."""
from __future__ import annotations

from typing import Any, Iterator

import torch

from ..memory import optimizer_tensors


class WrappedOptimizer:
    """Delegates everything but ``step``/``zero_grad`` to ``self.optimizer``."""

    optimizer: Any

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(sd)

    def state_tensors(self) -> Iterator[torch.Tensor]:
        return optimizer_tensors(self.optimizer)
