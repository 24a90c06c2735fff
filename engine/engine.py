"""The colocated engine: add requests, step, stream outputs. Also the Python API (`LLM.generate`).

One step reads in three calls: schedule -> run -> postprocess.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import Sequence

import jax
import numpy as np

from engine.block_manager import BlockAllocator, BlockTable
from engine.config import EngineConfig
from engine.lora import AdapterRegistry, LoraSlots
from engine.models import LoadedModel, load_model
from engine.output import OutputStream, RequestOutput
from engine.request import FinishReason, Request, Status, TokenLogprobs
from engine.runner import ModelRunner, Row, SampleRow
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.scheduler import ScheduledStep, Scheduler
from engine.sharding import make_mesh
from engine.weights import build_weights

log = logging.getLogger(__name__)


class LLMEngine:
    """Continuous batching over one model on one mesh. Not thread-safe: drive it from one thread."""

    def __init__(self, model: LoadedModel, config: EngineConfig, devices: Sequence[jax.Device] | None = None):
        self.model = model
        self.config = config
        self.tokenizer = model.tokenizer
        self.mesh = make_mesh(config.tp, devices)
        dtype = jax.numpy.dtype(config.dtype)
        weights = build_weights(model.config, model.host_weights, self.mesh, dtype)
        self.lora_slots = None
        if config.max_loras:
            self.lora_slots = LoraSlots(
                model.config, config.max_loras, config.max_lora_rank, self.mesh, dtype
            )
        self.loras = AdapterRegistry(model.config, config.max_lora_rank, enabled=self.lora_slots is not None)
        self.runner = ModelRunner(model.config, config, weights, self.mesh, self.lora_slots)
        self.allocator = BlockAllocator(config.num_blocks)
        self.scheduler = Scheduler(config, self.allocator, self.lora_slots)
        self._streams: dict[str, OutputStream] = {}
        self._ids = itertools.count()
        self.retained: dict[str, Request] = {}  # finished requests whose blocks a transfer still reads

    @classmethod
    def from_model(
        cls,
        ref: str | None = None,
        config: EngineConfig | None = None,
        devices: Sequence[jax.Device] | None = None,
        warmup: bool = True,
        progress: bool = True,
    ) -> LLMEngine:
        """Loads a model (path or known name; None: the default) and compiles every shape."""
        t0 = time.perf_counter()
        engine = cls(load_model(ref), config or EngineConfig(), devices)
        loaded = time.perf_counter()
        if warmup:
            engine.runner.warmup(progress=progress)
        log.info("engine ready: load %.1f s, warmup %.1f s", loaded - t0, time.perf_counter() - loaded)
        return engine

    # ---- requests -------------------------------------------------------------------------------------
    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: str | None = None,
        lora_fingerprint: str | None = None,
    ) -> Request:
        """Validates and tokenizes; raises InvalidRequestError naming the bad field.

        `lora`: the adapter's name (None: the base model); with `lora_fingerprint` (a peer's copy of the
        adapter) the adapter loaded here must have the same weights (AdapterMismatchError otherwise).
        """
        vocab = self.model.config.vocab_size
        params.validate(vocab, self.config.max_logprobs)
        if isinstance(prompt, str):
            if len(prompt) > 16 * self.config.max_model_len:  # refuse before spending CPU on tokenizing it
                raise InvalidRequestError(
                    "prompt", f"longer than {16 * self.config.max_model_len} characters"
                )
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise InvalidRequestError("prompt_token_ids", f"token ids must be in [0, {vocab})")
        if not prompt_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(prompt_ids) + params.max_tokens > self.config.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model length {self.config.max_model_len}",
            )
        return Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=prompt_ids,
            params=params,
            seed=params.seed if params.seed is not None else secrets.randbits(63),
            blocks=BlockTable(self.allocator, self.config.block_size),
            lora=None if lora is None else self.loras.resolve(lora, lora_fingerprint),
        )

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs) -> str:
        return self.add_prepared_request(self.make_request(prompt, params or SamplingParams(), **kwargs))

    def add_prepared_request(self, request: Request) -> str:
        """Queues a request built by make_request (callers may set its seed or retain_kv first)."""
        if request.request_id in self._streams or request.request_id in self.retained:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        self._streams[request.request_id] = OutputStream(request, self.tokenizer, self.config.max_model_len)
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """Cancels a request and frees its blocks; False when it is not (or no longer) here."""
        if self.release(request_id):
            return True
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        stream.request.finish_reason = FinishReason.ABORT
        stream.request.status = Status.FINISHED
        self.scheduler.remove(stream.request)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One model step for the scheduled requests; returns what each produced."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        sampled = self._run(step)
        return self._postprocess(sampled)

    def _run(self, step: ScheduledStep) -> list[tuple[Request, int, TokenLogprobs | None]]:
        if step.prefill:
            rows = [
                Row(
                    c.request.all_ids[c.start : c.start + c.length],
                    c.start,
                    c.request.blocks.block_ids,
                    c.request.lora_slot,
                )
                for c in step.prefill
            ]
            samplers = [c.request for c in step.prefill if c.samples]
            for chunk in step.prefill:
                chunk.request.num_computed += chunk.length
            indices = [i for i, c in enumerate(step.prefill) if c.samples]
        else:
            rows = [
                Row([r.output_ids[-1]], r.num_computed, r.blocks.block_ids, r.lora_slot) for r in step.decode
            ]
            samplers = list(step.decode)
            for request in step.decode:
                request.num_computed += 1
            indices = list(range(len(rows)))
        logits = self.runner.forward(rows)
        if not samplers:
            return []
        sample_rows = [
            SampleRow(r.params, r.seed, r.num_tokens, r.prompt_ids, r.output_ids) for r in samplers
        ]
        result = self.runner.sample(logits, sample_rows, indices)
        out = []
        for i, request in enumerate(samplers):
            logprobs = None
            if request.params.logprobs is not None:
                n = request.params.logprobs
                top = list(
                    zip(result.top_ids[i, :n].tolist(), result.top_logprobs[i, :n].tolist(), strict=True)
                )
                logprobs = TokenLogprobs(int(result.tokens[i]), float(result.logprob[i]), top)
            out.append((request, int(result.tokens[i]), logprobs))
        return out

    def _postprocess(self, sampled: list[tuple[Request, int, TokenLogprobs | None]]) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for request, token, logprobs in sampled:
            if request.first_token_time is None:
                request.first_token_time = now
            if request.status is Status.WAITING:
                self.scheduler.promote(request)
            output = self._streams[request.request_id].on_token(token, logprobs)
            if output.finished:
                request.status = Status.FINISHED
                self.scheduler.remove(request, free_blocks=not request.retain_kv)
                if request.retain_kv:
                    self.retained[request.request_id] = request
                del self._streams[request.request_id]
            outputs.append(output)
        return outputs

    # ---- disaggregation hooks (the prefill and decode roles) -----------------------------------------
    def release(self, request_id: str) -> bool:
        """Prefill role: frees the blocks of a finished request kept for a transfer (retain_kv)."""
        request = self.retained.pop(request_id, None)
        if request is None:
            return False
        request.blocks.release()
        return True

    def reserve_for_transfer(self, request: Request) -> bool:
        """Decode role: allocates blocks for the prompt's KV, arriving from a prefill server (check + do)."""
        s = self.scheduler
        if len(s.running) + len(s.prefilling) + s.num_incoming >= self.config.max_num_seqs:
            return False
        if not request.blocks.can_reserve(len(request.prompt_ids) + 1):
            return False
        if not s.pin_adapter(request):  # every adapter slot is pinned by other adapters' requests
            return False
        request.blocks.reserve(len(request.prompt_ids) + 1)
        s.num_incoming += 1
        request.incoming = True
        return True

    def abandon_transfer(self, request: Request) -> None:
        """Decode role: the transfer failed or was cancelled; frees the reserved blocks (idempotent)."""
        if request.incoming:
            request.incoming = False
            self.scheduler.num_incoming -= 1
            request.blocks.release()
            self.scheduler.unpin_adapter(request)

    def discard(self, request: Request) -> None:
        """Frees whatever `request` holds, wherever it is (queued, decoding, receiving KV, retained).

        Idempotent; run it after any cancel or failure. On the engine thread it runs after every command
        submitted before it, so a reservation still in flight when its caller was cancelled is undone too.
        """
        self.abandon_transfer(request)
        self.abort(request.request_id)

    def insert_kv(self, chunk, block_ids: Sequence[int]) -> None:
        """Decode role: writes one transferred KV chunk into this engine's cache at `block_ids`."""
        import kvtransfer

        self.runner.cache = kvtransfer.insert(self.runner.cache, chunk, block_ids)

    def register_prefilled(
        self, request: Request, first_token: int, logprobs: TokenLogprobs | None
    ) -> RequestOutput:
        """Decode role: the prompt's KV is in `request`'s blocks; record the first token and start decoding.

        Returns the output for the first token (the request may already be finished by it).
        """
        self.scheduler.num_incoming -= 1
        request.incoming = False
        request.num_computed = len(request.prompt_ids)
        request.first_token_time = time.monotonic()
        stream = OutputStream(request, self.tokenizer, self.config.max_model_len)
        output = stream.on_token(first_token, logprobs)
        if output.finished:
            request.status = Status.FINISHED
            request.blocks.release()
            self.scheduler.unpin_adapter(request)
        else:
            self._streams[request.request_id] = stream
            self.scheduler.add_running(request)
        return output

    # ---- the Python API -------------------------------------------------------------------------------
    def prompt_logits(self, prompt_ids: Sequence[int], lora: str | None = None) -> np.ndarray:
        """float32 logits [vocab] after the prompt, prefilled in the engine's chunks; holds no blocks after.

        Must not be called while requests are in flight (it runs steps of its own).
        """
        request = self.make_request(list(prompt_ids), SamplingParams(max_tokens=1), lora=lora)
        request.blocks.reserve(len(prompt_ids))
        try:
            if not self.scheduler.pin_adapter(request):
                raise RuntimeError("every adapter slot is pinned")
            step = self.config.max_prefill_tokens
            for start in range(0, len(prompt_ids), step):
                chunk = list(prompt_ids[start : start + step])
                logits = self.runner.forward([Row(chunk, start, request.blocks.block_ids, request.lora_slot)])
            return np.asarray(logits)[0]
        finally:
            request.blocks.release()
            self.scheduler.unpin_adapter(request)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        lora: str | Sequence[str | None] | None = None,
    ) -> list[Completion]:
        """Runs prompts to completion together (continuous batching); results in prompt order.

        `lora`: one adapter name for all prompts, or one per prompt (None: the base model)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if lora is None or isinstance(lora, str):
            lora = [lora] * len(prompts)
        ids = [self.add_request(p, sp, lora=name) for p, sp, name in zip(prompts, params, lora, strict=True)]
        done: dict[str, Completion] = {
            rid: Completion(rid, self._streams[rid].request.prompt_ids, [], "", None) for rid in ids
        }
        while any(c.finish_reason is None for c in done.values()):
            for output in self.step():
                completion = done.get(output.request_id)
                if completion is None:
                    continue
                completion.token_ids += output.new_token_ids
                completion.text += output.text
                completion.logprobs += output.logprobs
                if output.finished:
                    completion.finish_reason = output.finish_reason.value
        return [done[rid] for rid in ids]


@dataclasses.dataclass
class Completion:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
