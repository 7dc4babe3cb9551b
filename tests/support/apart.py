"""A generator holding weights of its own, for the overlap (``max_staleness``) tests: the transformers
backend on a copy of the policy, which the trainer's weight sync updates every iteration as it does a vLLM
server (full weights here). Sampling stays exactly the transformers backend's, so runs repeat."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import torch

from loop_trainer.rollout import TransformersBackend


class ApartBackend(TransformersBackend):
    holds_own_weights = True

    def __init__(self, model: torch.nn.Module, **kwargs):
        super().__init__(copy.deepcopy(model).eval(), **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = self.model.state_dict(keep_vars=True)  # tied weights too (lm_head: the embedding)
        with torch.no_grad():
            for name, tensor in weights:
                own[name].copy_(tensor)

    def load_adapter(self, adapter_dir: str, version: int) -> None:
        raise NotImplementedError("ApartBackend serves full weights")

    def probe_logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(token_ids)])
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, :-1].float() / (self.temperature or 1.0)
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)

    def sleep(self) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass
