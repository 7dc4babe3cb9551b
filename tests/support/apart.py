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


class VersionedApartBackend(ApartBackend):
    """An :class:`ApartBackend` holding several policy versions at once (``max_staleness`` above 1; HoldsVersions):
    each load keeps a copy of that version, which its view samples, as a vLLM server keeps one LoRA adapter per
    version."""

    def __init__(self, model: torch.nn.Module, **kwargs):
        super().__init__(model, **kwargs)
        self.view_kwargs = kwargs
        self.views: dict[int, TransformersBackend] = {}
        self.released: list[int] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        super().load_weights(weights)  # the newest version: what the probe check reads
        assert version is not None, "a generator holding versions is told which one it loads"
        self.views[version] = TransformersBackend(copy.deepcopy(self.model).eval(), **self.view_kwargs)

    def at_version(self, version: int) -> TransformersBackend:
        return self.views[version]

    def release_versions_below(self, version: int) -> None:
        for old in sorted(v for v in self.views if v < version):
            del self.views[old]
            self.released.append(old)
