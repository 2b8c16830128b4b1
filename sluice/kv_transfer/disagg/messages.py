"""The typed frames of prefill/decode disaggregation (msgspec, versioned, tagged: see
sluice/channel.py). ZMQ control frames between the ranks of a prefill and a decode instance,
the fake backend's data frames, and the JSON bodies of the bootstrap server.

    decode rank -> prefill rank   TransferRequest  (where to write one room's KV, and until when)
                                  AbortRoom        (the decode request ended: stop, report back)
    prefill rank -> decode rank   TransferStatus   (Transferring; then Success with the first
                                                    token and its logprobs, or Failed + why)
    fake backend                  FakeWrite + raw payload frame -> FakeWriteAck

A decode rank on the prefill's host hands over its cache in its TransferRequest (`export`):
ShmExport (a CPU cache in shared memory) or CudaIpcExport (a GPU cache's IPC handles), plain
typed fields and bytes, never pickled (shm.py).
"""

from __future__ import annotations

import msgspec

from sluice.channel import Message, MessageDecoder

# token id -> (logprob, rank), as sluice.core.outputs.PositionLogprobs
Logprobs = dict[int, tuple[float, int]]


class ShmExport(msgspec.Struct, tag="shm", forbid_unknown_fields=True):
    """A decode rank's CPU cache: one anonymous shared-memory file (memfd, never named under
    /dev/shm) holding every layer, opened by a peer on the same host through
    /proc/<pid>/fd/<fd> and checked by inode and size."""

    host_id: str  # shm.host_id() of the decode's host
    pid: int
    pid_start: int  # the process's start time (clock ticks): a reused pid is not the same peer
    fd: int
    inode: int
    nbytes: int
    base_address: int  # the decode's address of the segment's first byte


class CudaIpcLayer(msgspec.Struct, forbid_unknown_fields=True):
    """One layer's cache as torch's CUDA storage sharing describes it (the fields of
    `UntypedStorage._share_cuda_()`), plus where the layer sits in that storage."""

    address: int  # the decode's data_ptr() of the layer's [2, nb, bs, h, d] tensor
    nbytes: int
    tensor_offset: int  # bytes from the storage's start to the layer's
    device: int
    handle: bytes  # cudaIpcMemHandle_t of the allocation
    storage_nbytes: int
    storage_offset: int  # of the storage within the allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    # The GPU's UUID ("GPU-..."): `device` is the decode's index, which means another GPU (or
    # none) in a process with other CUDA_VISIBLE_DEVICES; the prefill opens it by this.
    device_uuid: str = ""


class CudaIpcExport(msgspec.Struct, tag="cuda_ipc", forbid_unknown_fields=True):
    """A decode rank's GPU cache, one layer per entry (docs/kv-transfer.md)."""

    host_id: str
    pid: int
    pid_start: int
    layers: list[CudaIpcLayer]


CacheExport = ShmExport | CudaIpcExport


class TransferRequest(Message, tag="pd.transfer_request"):
    """Sent by a decode rank to each prefill rank it asks (heads.py says which, and what each
    writes: the prefill rank works its slice out from the decode rank and TP size)."""

    room: int
    decode_rank: int
    tp_size: int  # the decode instance's
    # Where the prefill rank sends TransferStatus frames ("tcp://host:port").
    status_address: str
    # The decode rank's transfer endpoint (Mooncake: "host:rpc_port"; fake: "tcp://host:port").
    session: str
    backend: str
    # Decode's KV layout, checked against the prefill's before anything is written.
    block_size: int
    kv_dtype: str
    head_dim: int
    num_kv_heads: int  # on this decode rank
    model_num_kv_heads: int  # the model's, over every rank
    layer_addresses: list[int]  # base address of each layer's [2, nb, bs, h, d] tensor
    num_blocks: int  # nb of decode's tensors (V starts nb blocks after K)
    # Send the prefill's blocks [first_block, first_block + len(block_ids)) of the prompt into
    # these decode blocks (decode already holds the blocks before first_block: prefix cache).
    first_block: int
    block_ids: list[int]
    num_prompt_tokens: int
    # The prefill must not start (or go on) writing after this many seconds from receipt:
    # decode frees the blocks after its own, later, deadline.
    lease_s: float
    # The decode's cache for the same-host backend (shm), sent with every ask (a few dozen
    # bytes) and mapped once per peer by the prefill.
    export: CacheExport | None = None


class AbortRoom(Message, tag="pd.abort_room"):
    room: int
    decode_rank: int
    reason: str


class TransferStatus(Message, tag="pd.transfer_status"):
    room: int
    prefill_rank: int
    state: int  # a KVPoll value
    first_token: int | None = None
    first_logprobs: Logprobs | None = None
    error: str | None = None


class FakeWrite(Message, tag="pd.fake_write"):
    """Header of one batch of writes; the payload frame that follows is the bytes of every
    write, concatenated in order."""

    batch_id: int
    addresses: list[int]
    lengths: list[int]


class FakeWriteAck(Message, tag="pd.fake_write_ack"):
    batch_id: int
    error: str | None = None  # None: every byte written


class FakePing(Message, tag="pd.fake_ping"):
    batch_id: int


class RankRoute(msgspec.Struct, forbid_unknown_fields=True):
    """One prefill rank as it registers with its bootstrap server (PUT /route, JSON): with
    its TP size and heads, so a decode instance of another TP size knows whom to ask for
    which heads (heads.py), or refuses a pair it cannot serve."""

    rank: int
    world_size: int  # the prefill instance's TP size
    control_address: str  # "tcp://host:port": where decode ranks send TransferRequest
    backend: str  # the prefill's transfer_backend setting ("auto", "shm", ...)
    block_size: int
    kv_dtype: str
    head_dim: int
    num_kv_heads: int  # on this rank: [rank * model_num_kv_heads // world_size, ...)
    model_num_kv_heads: int
    num_layers: int
    engine_id: str
    # The backends this rank has up (auto: shm and mooncake) and its host (shm.host_id()): the
    # decode picks the pair's backend from them (transfer.choose_backend).
    backends: list[str] = msgspec.field(default_factory=list)
    host_id: str = ""


class Route(msgspec.Struct):
    """GET /route: every rank of the prefill instance (200 only once all registered)."""

    world_size: int
    ranks: list[RankRoute]
    instance_id: str  # new at every start of the bootstrap server


class Health(msgspec.Struct):
    """GET /health: a prefill instance that restarted has another instance_id."""

    instance_id: str


ControlFrame = TransferRequest | AbortRoom | TransferStatus
FakeFrame = FakeWrite | FakePing


def control_decoder() -> MessageDecoder:
    return MessageDecoder(ControlFrame, "PD control", "the prefill and decode instances")


def fake_decoder() -> MessageDecoder:
    return MessageDecoder(FakeFrame, "PD fake transfer", "the prefill and decode instances")


def fake_ack_decoder() -> MessageDecoder:
    return MessageDecoder(FakeWriteAck, "PD fake transfer ack",
                          "the prefill and decode instances")
