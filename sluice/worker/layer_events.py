"""Per-layer connector hooks that survive CUDA-graph capture.

A captured forward cannot call Python, so a KV connector's per-layer work is bridged through
external CUDA events, one pair per attention layer, recorded into the graphs at capture: each
layer's attention waits on its `loaded` event (an external wait node), and each layer records its
`stored` event once its KV of the step is in the cache (an external record node). Around a
replay the runner drives the connector on a bridge stream: before it, for every layer, the
connector's `wait_for_layer_load` then a record of `loaded` (so the graph's layer waits for that
layer's load only, and the first layers compute while later ones still load); after it, for
every layer, a wait on `stored` then the connector's `save_kv_layer` (so each layer's save starts
as soon as the graph has stored that layer). A step with no loads records nothing: the graph's
wait nodes find the last records complete. Graphs are captured this way only when a connector is
configured; without one they are exactly as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sluice.attention.metadata import AttentionMetadata
    from sluice.worker.kv_connector import KVConnectorWorker


class GraphLayerEvents:
    """The LayerKVHooks a captured forward runs (see the module docstring)."""

    def __init__(self, layer_names: list[str], device: torch.device) -> None:
        self.layer_names = layer_names
        self.loaded = {name: torch.cuda.Event(external=True) for name in layer_names}
        self.stored = {name: torch.cuda.Event(external=True) for name in layer_names}
        # Record each once now: torch creates the CUDA event on its first record, and a wait
        # on an event never created would be dropped from the capture.
        for event in (*self.loaded.values(), *self.stored.values()):
            event.record()
        self.bridge = torch.cuda.Stream(device=device)

    # ---- inside the captured forward ------------------------------------------------------

    def wait_for_layer_load(self, layer_name: str) -> None:
        torch.cuda.current_stream().wait_event(self.loaded[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata | None) -> None:
        self.stored[layer_name].record()

    # ---- around a replay -----------------------------------------------------------------

    def before_replay(self, connector: KVConnectorWorker) -> None:
        """This step's loads, layer by layer, into the graph's wait nodes."""
        with torch.cuda.stream(self.bridge):
            for name in self.layer_names:
                connector.wait_for_layer_load(name)
                self.loaded[name].record()

    def after_replay(self, connector: KVConnectorWorker,
                     kv_caches: dict[str, torch.Tensor]) -> None:
        """This step's saves, each layer's after the graph stored it."""
        with torch.cuda.stream(self.bridge):
            for name in self.layer_names:
                self.bridge.wait_event(self.stored[name])
                connector.save_kv_layer(name, kv_caches[name], None)
