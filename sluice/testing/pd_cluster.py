"""Real prefill/decode clusters on loopback, for tests and benchmarks: `sluice serve` prefill and
decode instances and a `sluice router`, each its own process group on ports picked free, with
logs in a folder.

    cluster = start_cluster(model, engine_flags, backend="fake")   # 1 prefill, 1 decode, router
    openai.OpenAI(base_url=f"{cluster.router.url}/v1", ...)
    cluster.prefills[0].kill()                                      # SIGKILL the whole group
    cluster.stop()                                                  # SIGTERM, then SIGKILL

Prefill and decode instances start at once (then the router, once they answer), so a cluster
costs about one server start-up. Every process is started with `setpriv --pdeathsig KILL`
where util-linux has it, in a session of its own: a test run that dies still takes its servers
with it, and `kill` ends the server and its engine-core and worker processes together, as a
crash of its machine would. Each process is an Instance (sluice/testing/instances.py).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.testing.instances import Instance, serve_argv, start_instances
from sluice.testing.instances import start_router as launch_router
from sluice.testing.servers import free_port


def pd_flags(role: str, backend: str, bootstrap_port: int | None = None,
             **extra: object) -> list[str]:
    """Flags of one half: --disaggregation-* when `extra` is empty, else the same as a
    --kv-transfer-config (vLLM's shape) with the extra PDConfig fields."""
    if not extra:
        flags = ["--disaggregation-mode", role, "--disaggregation-transfer-backend", backend]
        if bootstrap_port is not None:
            flags += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        return flags
    config_extra: dict[str, Any] = {"transfer_backend": backend, **extra}
    if bootstrap_port is not None:
        config_extra["bootstrap_port"] = bootstrap_port
    config = {"kv_connector": "PDConnector",
              "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
              "kv_connector_extra_config": config_extra}
    if role == "decode":
        config["kv_load_failure_policy"] = "fail"
    return ["--kv-transfer-config", json.dumps(config)]


@dataclass
class PDCluster:
    prefills: list[Instance]
    decodes: list[Instance]
    router: Instance | None
    workdir: Path
    extra: list[Instance] = field(default_factory=list)

    @property
    def instances(self) -> list[Instance]:
        return [*self.prefills, *self.decodes, *([self.router] if self.router else []),
                *self.extra]

    def stop(self) -> None:
        for instance in reversed(self.instances):
            instance.stop()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_cluster(model: str, engine_flags: list[str], backend: str = "fake",
                  num_prefills: int = 1, num_decodes: int = 1,
                  prefill_env: list[dict[str, str]] | None = None,
                  prefill_extra: dict[str, object] | None = None,
                  decode_extra: dict[str, object] | None = None,
                  router_flags: list[str] | None = None, workdir: Path | None = None,
                  with_router: bool = True, prefill_flags: list[str] | None = None,
                  decode_flags: list[str] | None = None, one_at_a_time: bool = False,
                  timeout_s: float = 180.0, prefill_backends: list[str] | None = None
                  ) -> PDCluster:
    """Prefill and decode instances of `model` with `engine_flags` (and each role's own flags),
    and a router over them; each prefill transfers over `backend`, or its own of
    `prefill_backends`. `one_at_a_time`: start each instance once the one before is up
    (instances sharing a GPU size their memory from what is free when they start)."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="sluice-pd-"))
    prefills, decodes = [], []
    for i in range(num_prefills):
        port, bootstrap_port = free_port(), free_port()
        flags = pd_flags("prefill", (prefill_backends or [backend] * num_prefills)[i],
                         bootstrap_port, **(prefill_extra or {}))
        env = (prefill_env or [{}] * num_prefills)[i]
        instance = Instance(f"prefill{i}", serve_argv(model, port, *engine_flags,
                                                      *(prefill_flags or []), *flags),
                            port, workdir, env)
        instance.bootstrap_port = bootstrap_port
        prefills.append(instance)
    for i in range(num_decodes):
        port = free_port()
        flags = pd_flags("decode", backend, **(decode_extra or {}))
        decodes.append(Instance(f"decode{i}", serve_argv(model, port, *engine_flags,
                                                         *(decode_flags or []), *flags),
                                port, workdir))
    start_instances([*prefills, *decodes], timeout_s, one_at_a_time)
    cluster = PDCluster(prefills, decodes, None, workdir)
    if with_router:
        try:
            cluster.router = start_router(prefills, decodes, workdir, router_flags or [])
        except BaseException:
            cluster.stop()
            raise
    return cluster


def start_router(prefills: list[Instance], decodes: list[Instance], workdir: Path,
                 flags: list[str], name: str = "router") -> Instance:
    instance_flags: list[str] = []
    for prefill in prefills:
        instance_flags += ["--prefill", prefill.url, str(prefill.bootstrap_port)]
    for decode in decodes:
        instance_flags += ["--decode", decode.url]
    return launch_router(instance_flags, workdir, flags, name)


def wait_blocks_back(instance: Instance, timeout_s: float = 20.0) -> dict[str, Any]:
    """Poll /debug/engine until every KV block is free and the cache's integrity holds;
    returns the last answer (AssertionError naming the state if it never happens)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = instance.engine_info()
        scheduler = info["scheduler"]
        if (info.get("integrity") == "ok" and scheduler["num_running"] == 0
                and scheduler["num_waiting"] == 0
                and scheduler["num_free_blocks"] == scheduler["num_blocks"]):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"{instance.name}: blocks not all back within {timeout_s:g} s: "
                                 f"{info}")
        time.sleep(0.1)
