"""The colocated engine: add requests, step, stream outputs. Also the Python API (`LLM.generate`).

One step reads in three calls: schedule -> run -> postprocess.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import secrets
import time
from collections.abc import Sequence

import jax
import numpy as np

from pdserve.engine.config import EngineConfig
from pdserve.engine.constraints import ConstraintCompiler
from pdserve.engine.core.kv_connector import KVConnector
from pdserve.engine.core.kv_events import KVEvent
from pdserve.engine.core.output import OutputStream, RequestOutput
from pdserve.engine.core.request import FinishReason, Request, Status, TokenLogprobs
from pdserve.engine.core.scheduler import Row, Scheduler, SchedulerOutput
from pdserve.engine.loading.sources import LoadedModel, load_model
from pdserve.engine.lora import AdapterRegistry
from pdserve.engine.lora_slots import LoraSlots
from pdserve.engine.model.attention import set_attention_impl
from pdserve.engine.model.sampler import mask_words
from pdserve.engine.model.sharding import make_mesh
from pdserve.engine.model.tpu_attention import kernel_attention, kernel_unsupported
from pdserve.engine.model.weights import build_weights
from pdserve.engine.model_runner import ModelRunner, SampleRow
from pdserve.engine.multihost import Publish
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)


class LLMEngine:
    """Continuous batching over one model on one mesh. Not thread-safe: drive it from one thread."""

    def __init__(self, model: LoadedModel, config: EngineConfig, devices: Sequence[jax.Device] | None = None):
        self.model = model
        self.mesh = make_mesh(config.tp, devices)
        platform = self.mesh.devices.flat[0].platform
        self.config = config = config.on_platform(platform)  # "auto" dtype resolved
        if platform == "tpu":  # jax's Pallas kernel behind the attention seam (the reference elsewhere)
            unsupported = kernel_unsupported(model.config, config.tp, config.dtype)
            if unsupported:
                log.warning("TPU attention kernel not used (%s): the reference attends", unsupported)
            else:
                set_attention_impl(kernel_attention(model.config, self.mesh))
        self.tokenizer = model.tokenizer
        dtype = jax.numpy.dtype(config.dtype)
        weights = build_weights(model.config, model.host_weights, self.mesh, dtype)
        self.lora_slots = None
        if config.max_loras and (model.config.num_experts or model.config.is_mla):
            raise ValueError(
                "LoRA adapters on mixture-of-experts or MLA models are not supported (max_loras > 0)"
            )
        if config.max_loras:
            self.lora_slots = LoraSlots(
                model.config, config.max_loras, config.max_lora_rank, self.mesh, dtype
            )
        self.loras = AdapterRegistry(model.config, config.max_lora_rank, enabled=self.lora_slots is not None)
        self.runner = ModelRunner(model.config, config, weights, self.mesh, self.lora_slots)
        self.scheduler = Scheduler(
            config,
            self.lora_slots,
            windowed_transfers=bool(model.config.layer_windows),
            release_window=model.config.widest_window,
            ring_blocks=self.runner.groups.ring_blocks(config.block_size, config.max_num_batched_tokens),
        )
        self._streams: dict[str, OutputStream] = {}
        self._ids = itertools.count()
        # The last step found nothing to run: queued requests wait for blocks or slots, and only a command
        # (an abort, arriving KV, a new request) can change that. The engine thread may sleep until one.
        self.stalled = False
        self._stepping: dict[str, Request] = {}  # the requests of the step under way (fail_step ends them)

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
            if len(prompt) > self.config.max_prompt_chars:  # refuse before spending CPU on tokenizing it
                raise InvalidRequestError("prompt", f"longer than {self.config.max_prompt_chars} characters")
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
            lora=None if lora is None else self.loras.resolve(lora, lora_fingerprint),
            matcher=None if params.constraint is None else self.constraints.matcher(params.constraint),
        )

    @functools.cached_property
    def constraints(self) -> ConstraintCompiler:
        """The constraint compiler for this model's tokenizer (built at the first constrained request)."""
        return ConstraintCompiler(self.tokenizer, self.model.config.vocab_size)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs) -> str:
        return self.add_prepared_request(self.make_request(prompt, params or SamplingParams(), **kwargs))

    def add_prepared_request(self, request: Request) -> str:
        """Queues a request built by make_request (callers may set its seed first)."""
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        self._streams[request.request_id] = OutputStream(request, self.tokenizer, self.config.max_model_len)
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """Cancels a request in any state and frees its blocks; False when it is not (or no longer) here.

        Idempotent; on the engine thread it runs after every command submitted before it, so a request
        added by a command still in flight when its caller was cancelled is removed too."""
        self._streams.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One model step for the scheduled requests; returns what each produced."""
        self._stepping = {}
        scheduled = self.scheduler.schedule()
        self.stalled = scheduled is None
        if scheduled is None:
            return []
        requests = self.scheduler.requests
        self._stepping = {row.request_id: requests[row.request_id] for row in scheduled.rows}
        self._stepping.update((r.request_id, r) for r in self.scheduler.sending)
        sampled = self._execute(scheduled)
        outputs = self.scheduler.update_from_output(scheduled, sampled, self._on_token)
        # the connector's worker side: hand over the KV of prompts computed in part, then of finished ones
        for row in scheduled.rows:
            request = self.scheduler.requests.get(row.request_id)
            if not row.samples and request is not None and request.status is Status.RUNNING:
                self.kv_connector.save_kv(
                    self.runner, request, self.scheduler.block_tables(request.request_id)
                )
        for request in list(self.scheduler.sending):
            self.kv_connector.send_kv(self.runner, request, self.scheduler.block_tables(request.request_id))
            self.scheduler.finish_sending(request.request_id)
        self._stepping = {}
        return outputs

    def fail_step(self, reason: str) -> list[RequestOutput]:
        """After step() raised: ends the requests of that step (their state may be half updated; those it
        finished already never had their outputs returned) with FinishReason.ERROR, freeing what they
        still hold; returns their last outputs. The other requests are untouched."""
        outputs = []
        for request_id, request in self._stepping.items():
            request.error = request.error or f"the step failed: {reason}"
            request.finish_reason = FinishReason.ERROR
            self.kv_connector.forget(request_id)
            self.abort(request_id)
            outputs.append(RequestOutput.failed(request))
        self._stepping = {}
        return outputs

    def _fail_request(self, request: Request, what: str, error: Exception) -> None:
        """A failure pinned to one request (its matcher, its detokenizer, its stop strings): it ends with
        FinishReason.ERROR at this step, the batch goes on."""
        log.exception("%s failed", what, extra={"request_id": request.request_id})
        request.error = f"{what}: {type(error).__name__}: {error}"
        request.finish_reason = FinishReason.ERROR

    def _execute(self, scheduled: SchedulerOutput) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Runs the step's rows; samples the rows that end their request's uncomputed tokens."""
        logits = self.runner.forward(scheduled.rows)
        indices = [i for i, row in enumerate(scheduled.rows) if row.samples]
        if not indices:
            return {}
        samplers = [self.scheduler.requests[scheduled.rows[i].request_id] for i in indices]
        sample_rows = [
            SampleRow(r.params, r.seed, r.num_tokens, r.prompt_ids, r.output_ids) for r in samplers
        ]
        allowed = self._allowed_tokens(samplers)  # on the host while the device runs the step
        result = self.runner.sample(logits, sample_rows, indices, allowed)
        out = {}
        for i, request in enumerate(samplers):
            token, logprobs = int(result.tokens[i]), None
            try:
                if request.matcher is not None:
                    token = self._advance_constraint(request, token, allowed[i])
                if request.params.logprobs is not None:
                    n = request.params.logprobs
                    top = list(
                        zip(result.top_ids[i, :n].tolist(), result.top_logprobs[i, :n].tolist(), strict=True)
                    )
                    logprobs = TokenLogprobs(token, float(result.logprob[i]), top)
            except Exception as e:  # noqa: BLE001 - pinned to this request
                self._fail_request(request, "sampling", e)
            out[request.request_id] = (token, logprobs)
        return out

    def _allowed_tokens(self, samplers: list[Request]) -> np.ndarray | None:
        """The sampling rows' allowed-token bitmasks (all ones where unconstrained); None: none is."""
        rows = [i for i, r in enumerate(samplers) if r.matcher is not None]
        if not rows:
            return None
        allowed = np.full((len(samplers), mask_words(self.model.config.vocab_size)), -1, np.int32)
        allowed[rows] = self.constraints.fill([samplers[i].matcher for i in rows])
        return allowed

    def _advance_constraint(self, request: Request, token: int, allowed: np.ndarray) -> int:
        """Advances the request's matcher with its sampled token (which `allowed`, its mask, let through);
        returns the token. An empty mask (the constraint allows nothing more) ends the request instead:
        its token becomes EOS, never shown."""
        if not allowed.any():
            request.finish_reason = FinishReason.DEAD_END
            return min(self.tokenizer.eos_token_ids, default=0)
        self._consume(request, token)
        return token

    def _consume(self, request: Request, token: int) -> None:
        """The request's matcher takes `token`. One it refuses (a work limit reached inside the matcher,
        or the EOS a prefill server sends for a dead end at the first token) ends the request as a dead
        end: nothing after the last token the constraint took is shown."""
        if not request.matcher.consume_token(token):
            log.warning(
                "constraint failed at token %d: %s",
                token,
                request.matcher.get_error(),
                extra={"request_id": request.request_id},
            )
            request.finish_reason = FinishReason.DEAD_END
            return
        if request.matcher.is_stopped() and token in self.tokenizer.eos_token_ids:  # ignore_eos or not
            request.finish_reason = FinishReason.STOP  # complete (a complete output allows only EOS next)

    def _on_token(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        """The scheduler's sink: detokenize, check stops; a finished request's stream ends."""
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        if request.finish_reason is not FinishReason.ERROR:
            try:
                output = self._streams[request.request_id].on_token(token, logprobs)
            except Exception as e:  # noqa: BLE001 - pinned to this request
                self._fail_request(request, "detokenizing", e)
        if request.finish_reason is FinishReason.ERROR:
            output = RequestOutput.failed(request)
        if output.finished:
            self._streams.pop(request.request_id, None)
        return output

    # ---- one engine over several processes (engine.multihost) -----------------------------------------
    def publish_device_ops(self, publish: Publish) -> None:
        """The leader of a multi-process engine: from now on every device operation (steps, sampling, KV
        reads and writes, adapter loads) goes to `publish` before it runs, for the other processes."""
        self.runner.publish = publish
        if self.lora_slots is not None:
            self.lora_slots.publish = publish

    # ---- what the prefix cache gains and loses (engine.core.kv_events) ---------------------------------
    def record_kv_events(self) -> None:
        """Starts keeping KV cache events (the first: AllBlocksCleared) for take_kv_events."""
        self.scheduler.kv.record_events()

    def take_kv_events(self) -> list[KVEvent]:
        """The KV cache events since the last call, oldest first."""
        return self.scheduler.kv.take_events()

    # ---- KV from elsewhere (the decode role; see engine.core.kv_connector) ---------------------------------
    @property
    def kv_connector(self) -> KVConnector:
        return self.scheduler.connector

    def set_kv_connector(self, connector: KVConnector) -> None:
        """Installs the connector of this engine's role (before any request is added)."""
        if self.scheduler.requests:
            raise RuntimeError("a KV connector is installed before requests are added")
        self.scheduler.connector = connector

    def remote_kv_arrived(
        self, request_id: str, token: int, logprobs: TokenLogprobs | None, num_cached_tokens: int = 0
    ) -> RequestOutput:
        """The request's prompt KV is in its blocks (DecodeConnector.load_kv) and `token` is its first
        token, sampled where the prompt was computed (`num_cached_tokens` of it found in a prefix cache
        there, under the request's constraint if it has one): it starts decoding, its constraint's matcher
        advanced by the token. Returns the token's output."""
        request = self.scheduler.requests[request_id]
        request.num_cached_tokens = num_cached_tokens
        if request.matcher is not None:
            self._consume(request, token)
        return self.scheduler.remote_kv_arrived(request_id, token, logprobs, self._on_token)

    def load_kv(self, request_id: str, chunk, first_block: int = 0) -> bool:
        """Writes one arriving KV chunk (verified, on this engine's mesh and layout; its tokens counted
        from block `first_block` of the prompt) into the request's blocks; False (nothing written) when
        the request no longer waits for KV (aborted meanwhile)."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status is not Status.WAITING_FOR_REMOTE_KV:
            return False
        blocks = self.scheduler.block_tables(request_id)[first_block:]
        self.kv_connector.load_kv(self.runner, blocks, chunk)
        return True

    def remote_kv_failed(self, request_id: str) -> None:
        """No KV will arrive for the request: it is prefilled here, in the blocks it already holds."""
        self.scheduler.remote_kv_failed(request_id)

    # ---- the Python API -------------------------------------------------------------------------------
    def prompt_logits(self, prompt_ids: Sequence[int], lora: str | None = None) -> np.ndarray:
        """float32 logits [vocab] after the prompt, prefilled in the engine's chunks; holds no blocks after.

        Must not be called while requests are in flight (it runs steps of its own).
        """
        request = self.make_request(list(prompt_ids), SamplingParams(max_tokens=1), lora=lora)
        kv, rid = self.scheduler.kv, request.request_id  # scratch blocks, outside the scheduler's requests
        if not kv.allocate(rid, len(prompt_ids)):
            raise RuntimeError("not enough free KV blocks")
        try:
            if not self.scheduler.pin_adapter(request):
                raise RuntimeError("every adapter slot is pinned")
            step = self.config.max_num_batched_tokens
            for start in range(0, len(prompt_ids), step):
                chunk = list(prompt_ids[start : start + step])
                logits = self.runner.forward([Row(chunk, start, kv.block_tables(rid), request.lora_slot)])
            return np.asarray(logits)[0]
        finally:
            kv.free(rid)
            self.scheduler.unpin_adapter(request)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        lora: str | Sequence[str | None] | None = None,
    ) -> list[FinishedSequence]:
        """Runs prompts to completion together (continuous batching); results in prompt order.

        `lora`: one adapter name for all prompts, or one per prompt (None: the base model)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if lora is None or isinstance(lora, str):
            lora = [lora] * len(prompts)
        ids = [self.add_request(p, sp, lora=name) for p, sp, name in zip(prompts, params, lora, strict=True)]
        done: dict[str, FinishedSequence] = {
            rid: FinishedSequence(rid, self.scheduler.requests[rid].prompt_ids, [], "", None) for rid in ids
        }
        while any(c.finish_reason is None for c in done.values()):
            for output in self.step():
                completion = done.get(output.request_id)
                if completion is None:
                    continue
                completion.token_ids += output.new_token_ids
                completion.text += output.text
                completion.logprobs += output.logprobs
                completion.num_cached_tokens = output.num_cached_tokens
                if output.finished:
                    completion.finish_reason = output.finish_reason.value
        return [done[rid] for rid in ids]


@dataclasses.dataclass
class FinishedSequence:
    """One prompt's whole result from `LLMEngine.generate` (the client's is services.client.Completion)."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
