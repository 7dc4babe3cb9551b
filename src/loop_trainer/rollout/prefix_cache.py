"""The KV caches of prefixes the transformers backend keeps within a collection, so that no prompt
token is prefilled twice: an episode's previous turn (:class:`PrefixCache`), and openings that
several prompts share (:class:`SharedPrefixes`).

Prompts that start alike are prefilled once: the K rollouts of a task start from the same
opening, and in most environments every task starts with the same system prompt (AppWorld's is
thousands of tokens). When requests join the decode loop together, :func:`plan` finds the prefixes
they share (a radix tree over their token ids) and :class:`SharedPrefixes` keeps each prefix's KV
cache for the rest of the collection, so a request that joins later still finds it.

Nothing sampled changes: a prompt prefilled as a prefix plus an extension has the KV cache and the
last-position logits of the same prompt prefilled whole, up to float rounding (the same equivalence
the per-episode :class:`PrefixCache` relies on).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .kv_layout import KV

Hit = tuple[int, KV]
"""A cached prefix a prompt extends: its length in tokens and its states."""

MIN_SHARED_TOKENS = 16
"""A prefix is prefilled on its own only if it adds this many tokens to the prefix it extends: below
that, the extra forward pass costs more than the tokens it saves."""


class PrefixCache:
    """The KV cache of replies that have finished, kept for the episode's next turn: its prompt
    starts with this turn's prompt and reply (append-only), so only the new tokens need a prefill.

    An entry is keyed by the tokens it holds (the prompt and the reply but its last token, which was
    never fed), is used once, and the oldest entries go beyond ``capacity``. The entries are only
    valid for the weights they were computed with: the backend keeps them for one event loop (one
    ``RolloutEngine.collect``) and drops them at the first look-up under another weights version
    (:class:`PrefixReuse`).
    """

    def __init__(self, capacity: int, weights_version: int):
        self.capacity = capacity
        self.clear(weights_version)

    def clear(self, weights_version: int) -> None:
        self.weights_version = weights_version
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.lengths: Counter[int] = Counter()

    def put(self, tokens: tuple[int, ...], layers: KV) -> None:
        if tokens in self.entries:
            return
        self.entries[tokens] = layers
        self.lengths[len(tokens)] += 1
        while len(self.entries) > self.capacity:
            self._drop(next(iter(self.entries)))

    def pop(self, prompt: list[int]) -> Hit | None:
        """The longest entry that ``prompt`` extends by at least one token, removed."""
        for length in sorted(self.lengths, reverse=True):
            if length < len(prompt) and (key := tuple(prompt[:length])) in self.entries:
                return length, self._drop(key)
        return None

    def _drop(self, key: tuple[int, ...]) -> KV:
        self.lengths[len(key)] -= 1
        if not self.lengths[len(key)]:
            del self.lengths[len(key)]
        return self.entries.pop(key)


class SharedPrefixes:
    """KV caches of prefixes shared by several prompts, for one weights version. Entries are not
    consumed (unlike an episode's previous turn, a shared opening serves every rollout that starts
    with it); the least recently used go once they hold more than ``capacity_tokens`` tokens."""

    def __init__(self, weights_version: int, capacity_tokens: int = 16384):
        self.capacity_tokens = capacity_tokens
        self.clear(weights_version)

    def clear(self, weights_version: int) -> None:
        self.weights_version = weights_version
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, tokens: tuple[int, ...], states: KV) -> None:
        if tokens in self.entries:
            return
        self.entries[tokens] = states
        self.tokens += len(tokens)
        while self.tokens > self.capacity_tokens and len(self.entries) > 1:
            dropped, _ = self.entries.popitem(last=False)
            self.tokens -= len(dropped)

    def longest(self, prompt: Sequence[int], at_most: int) -> tuple[int, ...] | None:
        """The longest stored prefix of ``prompt`` with at most ``at_most`` tokens (marked used)."""
        best = None
        for tokens in self.entries:
            if len(tokens) <= at_most and (best is None or len(tokens) > len(best)) and _starts_with(prompt, tokens):
                best = tokens
        if best is not None:
            self.entries.move_to_end(best)
        return best


class PrefixReuse:
    """The decode loop's prefix caches, as one part: what a joining prompt need not prefill again.
    ``turns``: the previous turns' caches (None: none kept, e.g. :meth:`~.backend.TransformersBackend.sample`);
    ``shared``: openings several prompts share (None: ``share_prefixes`` off). Both None where the
    model's cache cannot be cut per row (:class:`~.kv_layout.KVLayout`). Every entry holds for the
    weights version it was computed with and is dropped at the first look-up under another one."""

    def __init__(self, turns: PrefixCache | None = None, shared: SharedPrefixes | None = None):
        self.turns, self.shared = turns, shared

    @property
    def keeps_turns(self) -> bool:
        """Finished rows hand their states to :meth:`keep`."""
        return self.turns is not None

    def previous_turns(self, prompts: Sequence[list[int]], version: int) -> list[Hit | None]:
        """Per prompt, the longest previous turn it extends (taken out of the cache), or None."""
        if self.turns is None:
            return [None] * len(prompts)
        if self.turns.weights_version != version:
            self.turns.clear(version)  # computed with other weights
        return [self.turns.pop(prompt) for prompt in prompts]

    def shared_openings(
        self,
        prompts: Sequence[list[int]],
        version: int,
        prefill: Callable[[list[tuple[list[int], Hit | None]]], list[KV]],
    ) -> list[Hit | None]:
        """Per prompt, the shared prefix it extends, its KV cache computed now or earlier in the
        collection, or None: the prefixes ``prompts`` share are prefilled once, level by level, with
        ``prefill`` (prompts, each whole or extending a hit, alike within a call -> each one's states)."""
        if self.shared is None or not prompts:
            return [None] * len(prompts)
        if self.shared.weights_version != version:
            self.shared.clear(version)
        nodes, anchors = plan(prompts, self.shared)
        for level in sorted({node.level for node in nodes}):
            batch = [node for node in nodes if node.level == level]
            for with_parent in (False, True):
                part = [node for node in batch if (node.parent is not None) is with_parent]
                if not part:
                    continue
                states = prefill([(list(node.tokens), self._anchor_hit(node.parent)) for node in part])
                for node, node_states in zip(part, states, strict=True):
                    node.states = node_states
                    self.shared.put(node.tokens, node_states)
        return [self._anchor_hit(anchor) for anchor in anchors]

    def keep(self, tokens: tuple[int, ...], states: KV) -> None:
        """A finished row's cache (its prompt and its reply but the last token), for its next turn."""
        if self.turns is not None:
            self.turns.put(tokens, states)

    def _anchor_hit(self, anchor: Anchor) -> Hit | None:
        if anchor is None:
            return None
        if isinstance(anchor, PrefixNode):
            assert anchor.states is not None, "a node is prefilled before what extends it"
            return len(anchor.tokens), anchor.states
        assert self.shared is not None
        return len(anchor), self.shared.entries[anchor]


@dataclass(eq=False)
class PrefixNode:
    """A prefix to prefill on its own, as an extension of ``parent`` (a node of the same plan or a
    stored prefix) or from nothing."""

    tokens: tuple[int, ...]
    parent: PrefixNode | tuple[int, ...] | None
    level: int
    """1 + the parent's level (0 for a stored prefix or none): nodes of a level prefill together."""
    states: KV | None = field(default=None, repr=False)


Anchor = PrefixNode | tuple[int, ...] | None
"""What a prompt (or a node) extends: a node of this plan, a stored prefix, or nothing."""


def anchor_length(anchor: Anchor) -> int:
    if anchor is None:
        return 0
    return len(anchor.tokens if isinstance(anchor, PrefixNode) else anchor)


def plan(
    prompts: Sequence[Sequence[int]], stored: SharedPrefixes, min_shared: int = MIN_SHARED_TOKENS
) -> tuple[list[PrefixNode], list[Anchor]]:
    """The prefixes to prefill before ``prompts`` (in level order) and, per prompt, the longest
    prefix it can extend: a new node, a stored prefix, or None (prefill it whole). Every prefix is
    shorter than the prompts it serves, so each prompt keeps at least one token of its own to feed.

    A node is made where at least two prompts share ``min_shared`` tokens beyond the deepest prefix
    above them, and the tree is walked deeper (shared openings nest: one system prompt for every
    task, then one task's prompt for its K rollouts)."""
    nodes: list[PrefixNode] = []
    anchors: list[Anchor] = [None] * len(prompts)

    def deepest(anchor: Anchor, prompt: Sequence[int], at_most: int) -> Anchor:
        found = stored.longest(prompt, at_most)
        return found if found is not None and len(found) > anchor_length(anchor) else anchor

    def build(members: list[int], depth: int, anchor: Anchor) -> None:
        by_next: dict[int, list[int]] = {}
        for member in members:
            if len(prompts[member]) > depth + 1:
                by_next.setdefault(prompts[member][depth], []).append(member)
            else:
                anchors[member] = anchor
        for group in by_next.values():
            if len(group) == 1:
                member = group[0]
                anchors[member] = deepest(anchor, prompts[member], len(prompts[member]) - 1)
                continue
            shared = min(_common_length(prompts[group[0]], prompts[m]) for m in group[1:])
            shared = min(shared, min(len(prompts[m]) for m in group) - 1)
            here = deepest(anchor, prompts[group[0]], shared)
            if shared - anchor_length(here) >= min_shared:
                level = here.level + 1 if isinstance(here, PrefixNode) else 1
                here = PrefixNode(tuple(prompts[group[0]][:shared]), here, level)
                nodes.append(here)
            build(group, shared, here)

    build(list(range(len(prompts))), 0, None)
    nodes.sort(key=lambda node: node.level)
    return nodes, anchors


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def _starts_with(prompt: Sequence[int], prefix: tuple[int, ...]) -> bool:
    return len(prompt) >= len(prefix) and tuple(prompt[: len(prefix)]) == prefix
