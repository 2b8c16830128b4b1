"""KV cache groups: which layers share a block table, and the window each group frees behind.

A model of one kind of layer is one group (every layer, one block table: the plain
KVCacheManager). A model that mixes sliding-window and global layers (Gemma 3: five local
layers to a global one) is split into groups of one kind and of `group_size` layers: Gemma 3
270M's 3 global layers are one group, its 15 local ones 5 groups of 3. Every group has its own
block table over the one block pool, and layer j of every group reads and writes the same KV
tensor (a block id is a page of those `group_size` tensors), so a block costs `group_size`
layers' bytes and a windowed group's blocks behind its window go back to the pool for any group
to reuse (HybridKVCacheManager).

Where the two counts share no large divisor, groups are padded as vLLM's are: a kind's last
group may hold fewer layers, its unused tensors' pages wasted. Every group is a block table the
host fills each step, so fewer groups are less host work, and padding is less cache: the size
is the largest up to the smaller count whose padding wastes at most 1/16 of the layers' pages
(`PADDING_LIMIT`), else the greatest common divisor (no padding). Gemma 3 4B (29 windowed, 5
global): 7 groups of 5 for 34 layers (one padded slot) where the divisor gives 34 groups of 1;
27B (52, 10): 13 groups of 5 (3 padded) against 31 of 2; vLLM pads to the smaller count
whatever it wastes (27B: 7 groups of 10, 8 padded slots, 11% of the cache).

The split is used only where nothing but the model's own layers reads a request's blocks: a KV
connector (which saves, loads or sends a prompt's blocks whole) and a speculative proposer keep
one group of every layer and every block, as before; so does a window at least as long as
max_model_len, which never hides a position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class KVCacheGroups:
    # Per group: the window behind which its blocks are freed (None: every block kept).
    windows: tuple[int | None, ...]
    # Per group: its layers, as indices into the model's attention layers in order; the
    # groups' j-th layers share KV tensor j.
    layers: tuple[tuple[int, ...], ...]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Layers per group, the padded ones' slots counted: KV tensors the cache holds (a
        block's bytes are as many layers'). Group 0 is always full."""
        return len(self.layers[0])

    def max_blocks_per_request(self, max_model_len: int, block_size: int,
                               max_tokens_per_step: int) -> int:
        """The most blocks one request may need at once over every group: a global group all
        of max_model_len's; a windowed group of a split model its window and a step's tokens
        (with a block either side, and the last cached block it keeps)."""
        full = -(-max_model_len // block_size)
        if self.num_groups == 1:
            return full
        return sum(full if window is None
                   else min(full, (window - 1 + max_tokens_per_step) // block_size + 3)
                   for window in self.windows)

    def layer_slots(self) -> dict[int, tuple[int, int]]:
        """layer index -> (its group, its KV tensor)."""
        return {layer: (group, j) for group, members in enumerate(self.layers)
                for j, layer in enumerate(members)}


def one_group(num_layers: int, window: int | None) -> KVCacheGroups:
    return KVCacheGroups(windows=(window,), layers=(tuple(range(num_layers)),))


# The most of a cache's layer pages that padded groups may leave unused.
PADDING_LIMIT = 1 / 16


def group_size_for(num_global: int, num_local: int) -> int:
    """Layers per group of a mixed model (the module docstring): the largest size up to the
    smaller count whose padded slots are at most PADDING_LIMIT of the layers, else the
    greatest common divisor."""
    num_layers = num_global + num_local
    gcd = math.gcd(num_global, num_local)
    for size in range(min(num_global, num_local), gcd, -1):
        num_groups = -(-num_global // size) + -(-num_local // size)
        if num_groups * size - num_layers <= PADDING_LIMIT * num_layers:
            return size
    return gcd


def split_layers(sliding_layers: tuple[bool, ...], window: int) -> KVCacheGroups:
    """A mixed model's groups: its global layers and its windowed ones, each kind cut in
    order into groups of `group_size_for` layers (a kind's last one maybe fewer); global groups
    first."""
    global_layers = [i for i, sliding in enumerate(sliding_layers) if not sliding]
    local_layers = [i for i, sliding in enumerate(sliding_layers) if sliding]
    assert global_layers and local_layers, "one kind of layer is one group"
    size = group_size_for(len(global_layers), len(local_layers))
    windows: list[int | None] = []
    layers: list[tuple[int, ...]] = []
    for members, group_window in ((global_layers, None), (local_layers, window)):
        for start in range(0, len(members), size):
            windows.append(group_window)
            layers.append(tuple(members[start:start + size]))
    return KVCacheGroups(tuple(windows), tuple(layers))


def kv_cache_groups(config: Any) -> KVCacheGroups:
    """The groups of an EngineConfig's model: split where it mixes windowed and global layers
    (Gemma 3) and nothing else reads a request's blocks, else one group whose window is the
    model's where every layer attends in it (Mistral, Phi-3), widened by the draft tokens a
    verification may roll back (n-gram drafts). One group and no window (every block kept, the
    output the same) where something else reads older blocks: a KV connector (a CPU tier, the
    pool or PD moves a prompt's blocks whole) or a model proposer (a draft model's or EAGLE
    head's layers read the same block table unwindowed)."""
    hf_config = config.hf_config
    spec = config.scheduler_config.speculative_config
    num_layers = hf_config.num_hidden_layers
    # A window as long as the context hides no position: nothing to free.
    if (config.kv_transfer_config is not None or hf_config.sliding_window is None
            or hf_config.sliding_window >= config.scheduler_config.max_model_len):
        return one_group(num_layers, None)
    window = hf_config.window_of_every_layer()
    if window is None:
        sliding_layers = hf_config.gemma.sliding_layers
        # With drafts: the device n-gram fix-up writes one group's slots.
        if spec is not None or not any(sliding_layers):
            return one_group(num_layers, None)
        return split_layers(sliding_layers, hf_config.sliding_window)
    if spec is not None:
        if spec.method != "ngram":
            return one_group(num_layers, None)
        window += spec.num_speculative_tokens
    return one_group(num_layers, window)
