"""Which layers share a page: the layer groups behind releasing sliding-window pages.

A page normally holds one block of tokens for every layer, so it can only be freed when no layer
needs those tokens any more. In a model that mixes sliding-window and full-attention layers
(Gemma 2 and 3, gpt-oss), the sliding layers stop needing a block once it has left their window,
while the full layers keep it to the end. So such a model's layers are split into groups of
equal size, each of one kind, and a page holds one block of one group: a sequence has a page
table per group, and the tables of the sliding groups give their front pages back to the pool as
the window moves on (vLLM's hybrid allocator makes the same cut).

Groups hold `size` layers each: the fewest layers of either kind, so the smaller kind fills one
group exactly and the larger one is cut into groups of the same size, its last group padded with
slots no layer uses (Gemma-3-1B: 4 full and 22 sliding layers, groups of 4, one full group and 6
sliding ones, 2 slots of 28 unused). A model whose layers are all of one kind has one group: all
sliding (Mistral's first releases), its pages are released as a whole; all full, nothing changes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvctl.agent.model.config import ModelConfig


@dataclass(frozen=True)
class LayerGroups:
    """`slots[layer]` is (group, slot within the group's pages); `windows[group]` is the window
    of the group's layers (None: full attention); `size` layers per page."""

    size: int
    slots: tuple[tuple[int, int], ...]
    windows: tuple[int | None, ...]

    @property
    def count(self) -> int:
        return len(self.windows)

    @property
    def sliding(self) -> tuple[int, ...]:
        """The groups whose pages leave a window."""
        return tuple(g for g, window in enumerate(self.windows) if window is not None)

    @property
    def split(self) -> bool:
        """Whether a sequence has more than one page table (one per group)."""
        return self.count > 1

    @property
    def releases(self) -> bool:
        """Whether any group gives pages back while its sequence runs."""
        return bool(self.sliding)

    def ids(self, seq_id: Hashable) -> tuple[Hashable, ...]:
        """The pool's sequence ids for `seq_id`'s page tables, one per group."""
        if not self.split:
            return (seq_id,)
        return tuple((seq_id, g) for g in range(self.count))

    def layers_of(self, group: int) -> list[int]:
        """The model layers in `group`, in slot order."""
        found = sorted((slot, layer) for layer, (g, slot) in enumerate(self.slots) if g == group)
        return [layer for _, layer in found]

    def releasable(self, group: int, computed: int, page_size: int) -> int:
        """How many front pages of `group`'s table no query at `computed` or later reads."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, computed - window + 1) // page_size


def one_group(num_layers: int) -> LayerGroups:
    """Every layer in one page (the layout of a model without sliding layers)."""
    return LayerGroups(num_layers, tuple((0, i) for i in range(num_layers)), (None,))


def layer_groups(windows: Sequence[int | None], release: bool = True) -> LayerGroups:
    """The groups of a model whose layer i attends to the last `windows[i]` keys (None: all).

    Without `release`, or with a window that differs between sliding layers, every layer shares
    each page as before."""
    n = len(windows)
    sliding = [i for i, w in enumerate(windows) if w is not None]
    full = [i for i, w in enumerate(windows) if w is None]
    if not release or not sliding or len({windows[i] for i in sliding}) > 1:
        return one_group(n)
    window = windows[sliding[0]]
    if not full:
        return LayerGroups(n, tuple((0, i) for i in range(n)), (window,))
    size = min(len(full), len(sliding))
    slots: list[tuple[int, int]] = [(0, 0)] * n
    group_windows: list[int | None] = []
    for kind, layers in ((None, full), (window, sliding)):
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                slots[layer] = (len(group_windows), slot)
            group_windows.append(kind)
    return LayerGroups(size, tuple(slots), tuple(group_windows))


def page_groups(config: ModelConfig, release: bool = True) -> LayerGroups:
    """The page groups of a model: `layer_groups` of its layers' windows."""
    return layer_groups([config.window_of(i) for i in range(config.num_layers)], release)
