"""The worker's side of a KV connector (vLLM's KVConnectorBase_V1, worker role).

One per rank, next to the model runner; its scheduler-side twin is in
sluice/core/kv_connector.py. Per step the runner calls, in this order:

    bind_connector_metadata(meta)      the scheduler's plan for this step
    start_load_kv()                    start this step's loads (before the forward)
    -- the forward; for each attention layer, in order:
       wait_for_layer_load(layer)      before the layer reads its KV cache
       save_kv_layer(layer, kv, meta)  once the layer's KV of this step is stored
    wait_for_save()                    the step's saves are issued; later work is ordered after
    get_finished(finished_req_ids)     requests whose send / async load ended
    get_block_ids_with_load_errors()   blocks whose load failed (their requests do not sample)
    get_first_tokens()                 first tokens that ended loads (see core/kv_connector.py)
    get_load_errors()                  why the failed loads failed
    get_ready_requests()               held requests that may be scheduled now
    get_stats()                        counters since the last step, for metrics
    clear_connector_metadata()

A connector records a load's failed blocks before it reports the load finished, so a failure
is never reported in a later step than the load's end.

The hooks reach the attention layers through the step's AttentionMetadata (`kv_hooks`), not a
global forward context. A step that replays a CUDA graph keeps them too: the graphs of an engine
with a connector are captured with per-layer external events (sluice/worker/layer_events.py),
and the runner calls `wait_for_layer_load` for every layer before the replay and
`save_kv_layer` for every layer after it, in layer order, each on a bridge stream that the
graph's layer waits on (loads) or that waits on the graph's layer (saves): the first layers
compute while later ones load, and each layer's save starts once the graph stored it. So
"the current stream" in every hook is the stream to order against, whichever it is.

Device ordering: everything a hook issues on a side stream must be waited for on the compute
stream before the work that depends on it (a load before the layer's attention; a save before
any later step can overwrite the block: `wait_for_save` makes the compute stream wait), so
blocks freed by the scheduler are never reused while a transfer still touches them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from sluice.attention.kv_layout import KVCacheAllocator
    from sluice.attention.metadata import AttentionMetadata
    from sluice.config import KVTransferConfig
    from sluice.core.kv_connector import KVCacheSpec
    from sluice.core.outputs import FirstToken


class KVConnectorWorker(ABC):
    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec) -> None:
        self.config = config
        self.kv_cache_spec = kv_cache_spec
        self._metadata: Any = None

    def kv_cache_allocator(self) -> KVCacheAllocator | None:
        """Where this rank's cache is to live, for a connector that must place it (the PD
        decode's shared memory); None: allocated as usual. Asked once, before the cache is
        allocated and given to register_kv_caches."""
        return None

    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """This rank's paged caches, {layer_name: [2, num_blocks, block_size, heads, dim]} in
        layer order; called once, before any step."""
        return None

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @property
    def metadata(self) -> Any:
        return self._metadata

    def has_loads(self) -> bool:
        """Whether the bound plan loads anything this step."""
        return False

    def has_saves(self) -> bool:
        """Whether the bound plan saves anything this step (False spares a CUDA-graph step
        the per-layer save calls)."""
        return True

    def start_load_kv(self) -> None:
        """Start the bound plan's loads; they are waited on per layer."""
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once `layer_name`'s loads of this step are ordered before its attention."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata | None) -> None:
        """`kv_layer` holds this step's KV of `layer_name`: save what the plan says.
        `attn_metadata` is None when called after a CUDA-graph replay."""
        return None

    def wait_for_save(self) -> None:
        """The step's saves are issued; order later device work after them."""
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose send ended, requests whose asynchronous load ended) since the last
        call; `finished_req_ids`: requests the scheduler finished since the last step."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (reported once each)."""
        return set()

    def get_load_errors(self) -> dict[str, str]:
        """For failed loads reported in the last get_finished: why, by request id."""
        return {}

    def get_first_tokens(self) -> dict[str, FirstToken]:
        """For loads reported in the last get_finished that brought the whole prompt: the
        first output token the peer sampled, by request id."""
        return {}

    def get_ready_requests(self) -> set[str]:
        """Of the requests this step's plan says the scheduler holds back, those that may
        go now (say each again while the plan still lists it)."""
        return set()

    def get_stats(self) -> dict[str, float]:
        """Counters since the last call (bytes moved, latencies, errors)."""
        return {}

    def shutdown(self) -> None:
        """Release what the connector holds (threads, connections, host memory)."""
        return None
