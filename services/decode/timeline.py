"""Where a request's time to its first token went, for its `request ended` log line (services.decode.core):
moments marked as the request passes them, reported as the seconds between each and the one before.

    queue_s         arrival -> blocks allocated on this engine (its admission)
    prefill_s       -> the first KV chunk from the prefill server (routing, its queue, the first chunk's
                       compute); colocated: none
    kv_s            -> the last KV chunk and the first token from the prefill server
    insert_s        -> decoding here (the last inserts and the engine's step boundary)
    first_output_s  -> the first output to the client (colocated: the prompt's compute and its step)

A phase the request did not pass (colocated: the three of the transfer) is left out.
"""

from __future__ import annotations

import dataclasses
import time

# (the moment, the phase that ends there), in the order a request passes them
PHASES = (
    ("admitted", "queue_s"),
    ("kv_first", "prefill_s"),
    ("kv_done", "kv_s"),
    ("decoding", "insert_s"),
    ("first_output", "first_output_s"),
)


@dataclasses.dataclass
class Timeline:
    """A request's moments (time.monotonic) from `start`, its arrival."""

    start: float
    marks: dict[str, float] = dataclasses.field(default_factory=dict)
    traceparent: str | None = None  # the request's span (services.tracing), for the prefill call's metadata

    def mark(self, moment: str, at: float | None = None) -> None:
        """`moment` (one of PHASES') happened now, or `at`; a later attempt's replaces an earlier one's."""
        self.marks[moment] = time.monotonic() if at is None else at

    def intervals(self) -> dict[str, tuple[float, float]]:
        """Each phase passed (its name without `_s`): (start, end) in time.monotonic seconds."""
        out, previous = {}, self.start
        for moment, phase in PHASES:
            at = self.marks.get(moment)
            if at is not None:
                out[phase.removesuffix("_s")] = (previous, max(at, previous))
                previous = max(at, previous)
        return out

    def phases(self) -> dict[str, float]:
        """Each phase passed, in seconds (rounded to the millisecond), in PHASES' order."""
        return {f"{name}_s": round(end - start, 3) for name, (start, end) in self.intervals().items()}
