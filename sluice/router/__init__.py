"""The PD router: an OpenAI-compatible front that pairs prefill and decode instances.

    workers.py    the instances, their load and health checks (drop and re-admit)
    policies.py   round_robin, least_loaded, cache_aware
    proxy.py      one request: the pair, the room, both halves at once, retries
    metrics.py    Prometheus counters
    server.py     `sluice router` (the app, the command line)
"""
