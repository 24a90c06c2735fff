"""Conversions between protos and engine types (sampling parameters: services/sampling.py), and the
hand-rolled codec of Prefill stream messages.

A `PrefillMessage` carrying a KV frame is a protobuf message with one `bytes` field (kv_frame = 2). The
python protobuf runtime copies such fields on parse and serialize, which halves loopback throughput; here
the field is written as tag + varint length + the frame, and read back as a memoryview into the received
message, while header and trailer messages go through protobuf as usual. The bytes on the wire are
valid protobuf either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from pdserve.engine.core.output import RequestOutput
from pdserve.engine.core.request import FinishReason, TokenLogprobs
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.services.sampling import Limits
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import prefill_pb2 as prefill_pb

_KV_FRAME_TAG = b"\x12"  # field 2, wire type 2 (length-delimited)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def kv_frame_lead(frame_size: int) -> bytes:
    """What precedes a KV frame of `frame_size` bytes in its PrefillMessage (kvtransfer.encode_request's
    `lead`: the message is written in one copy)."""
    return _KV_FRAME_TAG + _varint(frame_size)


def serialize_prefill_message(message: prefill_pb.PrefillMessage | bytes) -> bytes:
    """Already-encoded KV frame messages (bytes) pass through; protobuf messages are serialized."""
    return message if isinstance(message, bytes) else message.SerializeToString()


@dataclasses.dataclass
class KVFrameBytes:
    """A received KV frame: a zero-copy view into the gRPC message."""

    data: memoryview


def deserialize_prefill_message(data: bytes) -> prefill_pb.PrefillMessage | KVFrameBytes:
    if data[:1] == _KV_FRAME_TAG:
        view = memoryview(data)
        length, shift, pos = 0, 0, 1
        while True:
            byte = view[pos]
            length |= (byte & 0x7F) << shift
            pos += 1
            if not byte & 0x80:
                break
            shift += 7
        if pos + length != len(view):
            raise ValueError(f"kv_frame field of {length} bytes in a message of {len(view)}")
        return KVFrameBytes(view[pos:])
    return prefill_pb.PrefillMessage.FromString(data)


def prompt_digest(prompt_ids) -> bytes:
    """PrefillHeader.prompt_digest: what the KV that follows was computed for (the decode side checks it
    against its own request's prompt)."""
    return hashlib.sha256(np.asarray(prompt_ids, "<u4").tobytes()).digest()


class PrefillProtocolError(ValueError):
    """A Prefill stream out of order: a frame before the header, a second header, nothing after the
    trailer, an end without one, a trailer that does not count the frames sent."""


class PrefillStreamOrder:
    """The Prefill stream's one order, header -> KV frames -> trailer, kept by both ends: the prefill
    server passes each message it writes through `write`, the decode server each it reads through
    `read` (PrefillProtocolError when out of order), and the trailer counts the frames between."""

    def __init__(self):
        self.state = "header"  # the next message expected: "header", then "frames" (or the trailer), "done"
        self.num_frames = 0
        self.num_bytes = 0  # of the frame messages, as they travel

    def write(self, message: prefill_pb.PrefillMessage | bytes) -> prefill_pb.PrefillMessage | bytes:
        """`message` (an encoded KV frame message, or a header or trailer), checked and counted."""
        if isinstance(message, bytes):
            self._frame(len(message))
        else:
            self._message(message)
        return message

    def read(self, item: prefill_pb.PrefillMessage | KVFrameBytes | None) -> str:
        """What the received `item` is ("header", "frame", "trailer"), checked in order."""
        if item is None:  # grpc.aio hands out None when the deserializer failed
            raise PrefillProtocolError("undecodable Prefill message")
        if isinstance(item, KVFrameBytes):
            self._frame(len(item.data))
            return "frame"
        return self._message(item)

    def end(self) -> None:
        """The stream ended: only after its trailer."""
        if self.state != "done":
            raise PrefillProtocolError("stream ended without a trailer")

    def _frame(self, nbytes: int) -> None:
        if self.state != "frames":
            where = "before the header" if self.state == "header" else "after the trailer"
            raise PrefillProtocolError(f"KV frame {where}")
        self.num_frames += 1
        self.num_bytes += nbytes

    def _message(self, message: prefill_pb.PrefillMessage) -> str:
        kind = message.WhichOneof("kind")
        if kind == "header" and self.state == "header":
            self.state = "frames"
        elif kind == "trailer" and self.state == "frames":
            if message.trailer.num_frames != self.num_frames:
                raise PrefillProtocolError(
                    f"trailer counts {message.trailer.num_frames} frames, {self.num_frames} were sent"
                )
            self.state = "done"
        else:
            raise PrefillProtocolError(f"{kind or 'an empty message'} where the {self.state} was due")
        return kind


# ---- requests that do not parse ------------------------------------------------------------------------
@dataclasses.dataclass
class Unparsable:
    """What a lenient deserializer returns for bytes that are not a valid message (e.g. bad UTF-8)."""

    error: str


def lenient(parse):
    """A gRPC request deserializer that never raises: the handler answers INVALID_ARGUMENT itself
    (a raising deserializer makes grpc answer UNKNOWN)."""

    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            return Unparsable(str(e))

    return deserialize


# ---- prompts ------------------------------------------------------------------------------------------
def prompt_from_proto(
    request: gen_pb.GenerateRequest, tokenizer, limits: Limits | None = None, max_chars: int | None = None
) -> str | list[int]:
    """The prompt of a GenerateRequest: text, token ids, or a chat rendered by the model's template
    (after its size is checked against `limits` and `max_chars`, before any rendering; None: the
    tokenizer's own length is the only bound)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            raise InvalidRequestError("chat", "must have at least one message")
        (limits or Limits()).check_chat(
            [m["role"] + m["content"] for m in messages], max_chars or 2**62, field="chat"
        )
        return tokenizer.encode_chat(messages, field="chat", max_chars=max_chars)
    raise InvalidRequestError("prompt", "one of text, token_ids or chat is required")


# ---- outputs -------------------------------------------------------------------------------------------
# Prefill servers list it in HandshakeResponse.features: they sample a first token under
# PrefillRequest.constraint; a decode server sends constrained requests to no other replica.
CONSTRAINTS_FEATURE = "constraints"

# The engine's finish reasons on the wire, read both ways (FINISH_NAMES: the client's side, the names the
# OpenAI front and `pdserve generate --json` show)
FINISH_REASONS = {
    None: gen_pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: gen_pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: gen_pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: gen_pb.FINISH_REASON_ABORT,
    FinishReason.DEAD_END: gen_pb.FINISH_REASON_CONSTRAINT_DEAD_END,
}
FINISH_NAMES = {wire: reason.value for reason, wire in FINISH_REASONS.items() if reason is not None}


def output_to_response(
    output: RequestOutput, request_id: str, prompt_ids: Sequence[int] = ()
) -> gen_pb.GenerateResponse:
    """One engine output as a streamed GenerateResponse (usage on the last one; `prompt_ids` and the
    prompt's logprobs on the first when the request asked for them)."""
    response = gen_pb.GenerateResponse(
        request_id=request_id,
        prompt_ids=prompt_ids,
        token_ids=output.new_token_ids,
        text=output.text,
        finish_reason=FINISH_REASONS[output.finish_reason],
        logprobs=[logprobs_to_proto(lp) for lp in output.logprobs],
        index=output.index,
    )
    if output.prompt_logprobs is not None:  # (the first position has none)
        response.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in output.prompt_logprobs[1:])
    if output.finished:
        response.usage.prompt_tokens = output.num_prompt_tokens
        response.usage.completion_tokens = output.num_output_tokens
        response.usage.cached_prompt_tokens = output.num_cached_tokens
    return response


def draft_aux_to_bytes(aux) -> bytes:
    """A draft head's input (PrefillTrailer.draft_aux) as the trailer carries it: float32, little-endian."""
    return np.asarray(aux, "<f4").tobytes()


def draft_aux_from_bytes(data: bytes) -> np.ndarray:
    """PrefillTrailer.draft_aux read back (check_first_token checks its size and values)."""
    if len(data) % 4:
        raise ValueError(f"draft_aux of {len(data)} bytes: not float32 values")
    return np.frombuffer(data, "<f4").astype(np.float32)


def logprobs_to_proto(lp: TokenLogprobs) -> gen_pb.TokenLogprobs:
    return gen_pb.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[gen_pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        rank=lp.rank,
    )


def logprobs_from_proto(lp: gen_pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top], lp.rank)
