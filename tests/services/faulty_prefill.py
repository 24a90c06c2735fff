"""A prefill-server that misbehaves on purpose, for the fault-injection tests.

It is the real prefill-server (same engine, same service) whose Prefill stream is altered per request,
cycling through FAULTS by request count: a corrupted payload byte, a frame cut short, a frame sent twice,
the trailer dropped, a stream that dies after the first frame, and one healthy stream. A request whose id
reads `fuzz:<offset>:<xor>:<cut>` instead gets exactly that damage on its first frame (hypothesis drives it);
`die:<n>:...` dies after its n-th frame (between two prompt chunks of a long prompt); `badtoken:<t>` sends
<t> as the first token in its trailer; `otherprompt` computes the KV of a prompt of the same length but its
last token. (The id a decode server sends is its engine's key: the client's id,
then `-` and a random suffix.)
Run: python -c "from tests.services.faulty_prefill import main; main()" ARGS... (prefill-server's flags)
"""

from __future__ import annotations

import sys

from pdserve.services.prefill import server as prefill_server

FAULTS = ("corrupt", "truncate", "duplicate", "no_trailer", "die", "ok")


class FaultyPrefillService(prefill_server.PrefillService):
    async def _prefill(self, request, context):
        fault = FAULTS[(self.counters.num_requests_total - 1) % len(FAULTS)]
        label = request.request_id.rpartition("-")[0]  # the client's id
        if label == "otherprompt":  # computes a prompt of the same length, its header honest about it
            request.prompt_ids[-1] = (request.prompt_ids[-1] + 1) % 1000
        if label.startswith("badtoken:"):
            async for message in super()._prefill(request, context):
                if not isinstance(message, bytes) and message.HasField("trailer"):
                    message.trailer.first_token = int(label.split(":")[1])
                yield message
            return
        if label.startswith("fuzz:"):
            async for message in self._fuzzed(request, context):
                yield message
            return
        if label.startswith("die:"):
            after, frames = int(label.split(":")[1]), 0
            async for message in super()._prefill(request, context):
                yield message
                frames += isinstance(message, bytes)
                if frames == after:
                    raise RuntimeError(f"injected: prefill died after frame {after}")
            return
        frames = 0
        async for message in super()._prefill(request, context):
            if isinstance(message, bytes):  # an encoded KV frame
                frames += 1
                if frames == 1 and fault == "corrupt":
                    message = message[:-10] + bytes([message[-10] ^ 0xFF]) + message[-9:]
                elif frames == 1 and fault == "truncate":
                    message = message[: len(message) // 2]
                elif frames == 1 and fault == "duplicate":
                    yield message
            elif message.HasField("trailer") and fault == "no_trailer":
                return
            yield message
            if fault == "die" and frames == 1:  # whatever would follow the first frame never comes
                raise RuntimeError("injected: prefill died mid-stream")

    async def _fuzzed(self, request, context):
        _, offset, xor, cut = request.request_id.rpartition("-")[0].split(":")
        first = True
        async for message in super()._prefill(request, context):
            if isinstance(message, bytes) and first:
                first = False
                data = bytearray(message)
                data[int(offset) % len(data)] ^= int(xor)
                message = bytes(data[: max(1, len(data) - int(cut))])
            yield message


def main() -> int:
    from pdserve.daemons import prefill_main

    return prefill_main(sys.argv[1:], service_class=FaultyPrefillService)
