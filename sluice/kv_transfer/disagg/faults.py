"""Faults injected into prefill/decode transfers for tests, set by environment variables of the
prefill instance (read once, when its connector starts):

    SLUICE_PD_FAULT_TRANSFER_FAIL_PROB   a room's write fails (nothing more written, Failed
                                         sent) with this probability
    SLUICE_PD_FAULT_SEND_DELAY_S         wait this long before writing a room's KV (the room
                                         shows Transferring meanwhile)
    SLUICE_PD_FAULT_SEND_HOLD_FILE       while a file exists at this path, no room's write and
                                         so no status (layer-wise writes during the prompt
                                         still go; rooms show Transferring; one that fails, e.g.
                                         aborted, ends at once): a test creates it to act while
                                         transfers are under way, however slow the machine,
                                         and removes it to let them go
    SLUICE_PD_FAULT_DROP_STATUS_PROB     the final status of a room is never sent, with this
                                         probability (decode's waiting timeout must end it)
    SLUICE_PD_FAULT_SEED                 seed of the draws (default: random)
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

_PREFIX = "SLUICE_PD_FAULT_"


@dataclass(frozen=True)
class Faults:
    transfer_fail_prob: float = 0.0
    send_delay_s: float = 0.0
    drop_status_prob: float = 0.0
    send_hold_file: str | None = None
    seed: int | None = None
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Faults:
        def number(name: str, low: float, high: float) -> float:
            text = environ.get(_PREFIX + name)
            if text is None or text == "":
                return 0.0
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{_PREFIX}{name} must be a number, got {text!r}") from None
            if not low <= value <= high:
                raise ValueError(f"{_PREFIX}{name} must be in [{low}, {high}], got {value}")
            return value

        seed_text = environ.get(_PREFIX + "SEED")
        seed = int(seed_text) if seed_text else None
        return cls(transfer_fail_prob=number("TRANSFER_FAIL_PROB", 0.0, 1.0),
                   send_delay_s=number("SEND_DELAY_S", 0.0, 3600.0),
                   drop_status_prob=number("DROP_STATUS_PROB", 0.0, 1.0),
                   send_hold_file=environ.get(_PREFIX + "SEND_HOLD_FILE") or None, seed=seed,
                   rng=random.Random(seed))

    @property
    def active(self) -> bool:
        return bool(self.transfer_fail_prob or self.send_delay_s or self.drop_status_prob
                    or self.send_hold_file)

    def holding(self) -> bool:
        return self.send_hold_file is not None and os.path.exists(self.send_hold_file)

    def fail_transfer(self) -> bool:
        return self.transfer_fail_prob > 0 and self.rng.random() < self.transfer_fail_prob

    def drop_status(self) -> bool:
        return self.drop_status_prob > 0 and self.rng.random() < self.drop_status_prob
