"""Prefill/decode disaggregation: prefill instances compute prompts, decode instances continue
them, and the KV cache moves between them (SGLang's design; see connector.py for the request's
path through both engines, sender.py and receiver.py for a room's state machine, transfer.py for
the backends (descriptors.py for what they copy), bootstrap.py for how the two sides find each
other, and sluice/router/ for the router that pairs them). Each instance may run tensor
parallelism, the two at different sizes where one is a multiple of the other: the connector's
worker half runs on every rank, and the decode rank asks the prefill ranks that hold its heads
(heads.py).

    poll.py         KVPoll: Failed < Bootstrapping < WaitingForInput < Transferring < Success
    params.py       the per-request kv_transfer_params (bootstrap host, port, room)
    config.py       PDConfig: the connector's settings (kv_connector_extra_config)
    messages.py     every frame on the wire (msgspec, versioned, tagged)
    bootstrap.py    the prefill's bootstrap server (PUT/GET /route, /health) and its clients
    heads.py        which KV heads each prefill rank sends each decode rank (TP sizes may differ)
    descriptors.py  what a write copies: whole blocks, or a head slice per token
    transfer.py     the backends: mooncake (Transfer Engine) and fake (loopback ZMQ); auto's choice
    shm.py          the same-host backend: the decode's cache in shared memory (CPU), CUDA IPC (GPU)
    manager.py      KVManager: one rank's sockets, threads and rooms
    sender.py       the prefill side (KVSender, PrefillKVManager)
    receiver.py     the decode side (KVReceiver, DecodeKVManager, heartbeat)
    faults.py       faults injected by environment variables, for tests
    connector.py    PDConnector: the scheduler and worker halves
"""
