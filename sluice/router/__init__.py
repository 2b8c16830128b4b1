"""The router: an OpenAI-compatible front over plain replicas (`--worker`) or prefill/decode
pairs (`--prefill`, `--decode`).

    workers.py    the instances, their load and health checks (drop and re-admit)
    policies.py   round_robin, least_loaded, cache_aware
    relay.py      what both modes share: retries, the commit at the first token, error shapes
    replicas.py   plain mode: one request, one colocated worker
    proxy.py      PD mode: the pair, the room, both halves at once
    metrics.py    Prometheus counters
    server.py     `sluice router` (the app, the command line)
"""
