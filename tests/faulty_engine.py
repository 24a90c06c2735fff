"""An engine that fails on purpose, for the supervision tests: a subclass of the real one (nothing is
patched), whose requests ask for their failure in a stop string.

- PINNED: the request's output stream raises at its second token, as a bug in its detokenizer or its stop
  matcher would: a failure of that request alone, which the engine pins to it.
- ONCE: the first step that runs it raises once, after scheduling (a step failure the engine cannot pin to
  one request: the requests of that step end, the engine serves on).
- BROKEN: from the step that would run it on, every step raises, as a lost device would: the engine is
  broken, and its daemon must say so and exit.

Run as a decode-server: python -c "from tests.faulty_engine import main; main()" ARGS...
"""

from __future__ import annotations

import sys

from pdserve.engine.core.output import OutputStream
from pdserve.engine.llm_engine import LLMEngine

PINNED = "\x00inject:pinned"
ONCE = "\x00inject:step"
BROKEN = "\x00inject:broken"


class FailingStream(OutputStream):
    def on_tokens(self, tokens, logprobs):
        if len(self.request.output_ids) >= 2:
            raise RuntimeError("injected: this request's output stream failed")
        return super().on_tokens(tokens, logprobs)


class FaultyEngine(LLMEngine):
    broken = False
    failed_once = False

    def add_prepared_request(self, request):
        request_id = super().add_prepared_request(request)
        if PINNED in request.params.stop:
            self.streams.open(request, FailingStream(request, self.tokenizer))
        return request_id

    def schedule_step(self):
        if self.broken or any(BROKEN in r.params.stop for r in self.scheduler.requests.values()):
            self.broken = True
            raise RuntimeError("injected: the device is gone")
        return super().schedule_step()

    def run_step(self, scheduled):
        rows = (
            [] if scheduled is None else [self.scheduler.requests[row.request_id] for row in scheduled.rows]
        )
        if not self.failed_once and any(ONCE in r.params.stop for r in rows):
            self.failed_once = True
            raise RuntimeError("injected: one step failed")
        return super().run_step(scheduled)


def main() -> int:
    from pdserve.daemons import decode_main

    return decode_main(sys.argv[1:], engine_class=FaultyEngine)
