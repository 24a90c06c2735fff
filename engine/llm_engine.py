"""The engine: one model on one mesh, continuous batching. Also the Python API (`generate`).

The daemons drive it through typed commands (`apply`, engine.boundary) and read what each `step()`
returns (EngineOutputs): nothing else crosses. One step reads in three calls: schedule -> run ->
postprocess.
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

from pdserve.engine import memory, multihost
from pdserve.engine.boundary import (
    Abort,
    AdapterState,
    AddRequest,
    Command,
    EngineOutputs,
    EngineStats,
    InsertKV,
    KVInsertError,
    QueueFull,
    RemoteKVDone,
    RemoteKVFailed,
    Utility,
)
from pdserve.engine.compile_cache import cache_state
from pdserve.engine.config import EngineConfig, ModelConfig, UnsupportedModelError, bucket_for
from pdserve.engine.constraints import ConstraintCompiler
from pdserve.engine.core.kv_connector import KVConnector, TransferReady
from pdserve.engine.core.kv_groups import KVGroups
from pdserve.engine.core.output import OutputStream, RequestOutput
from pdserve.engine.core.request import FinishReason, Request, Status, TokenLogprobs
from pdserve.engine.core.scheduler import Row, SampledToken, Scheduler, SchedulerOutput
from pdserve.engine.core.speculation import accept
from pdserve.engine.draft_runner import DraftRunner
from pdserve.engine.host_kv import HostLoad
from pdserve.engine.loading.eagle3 import Eagle3Head, load_eagle3_head
from pdserve.engine.loading.sources import LoadedModel, load_model
from pdserve.engine.lora import AdapterRegistry
from pdserve.engine.lora_slots import LoraSlots
from pdserve.engine.model.attention import AttentionFn, ragged_paged_attention_reference
from pdserve.engine.model.eagle3 import DraftModel
from pdserve.engine.model.sampler import SampleResult, mask_words, token_mask
from pdserve.engine.model.sharding import make_mesh
from pdserve.engine.model.tpu_attention import kernel_attention, kernel_unsupported
from pdserve.engine.model.weights import build_weights
from pdserve.engine.model_runner import ModelRunner, SampleRow, step_temps
from pdserve.engine.multihost import Publish
from pdserve.engine.sampling_params import MAX_PROMPT_LOGPROB_ENTRIES, InvalidRequestError, SamplingParams
from pdserve.kvtransfer import KVLayout

log = logging.getLogger(__name__)

MAX_CACHE_SALT_CHARS = 256  # vLLM's cache_salt is a short opaque string


class LLMEngine:
    """Continuous batching over one model on one mesh. Not thread-safe: drive it from one thread.

    `attention`: the attention implementation (default: jax's Pallas kernel over this engine's mesh on a
    TPU where it applies, else the reference; engine.model.attention)."""

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        devices: Sequence[jax.Device] | None = None,
        attention: AttentionFn | None = None,
        runner: ModelRunner | None = None,
        progress: bool = False,
    ):
        """`runner`: the device side, built here by default (on `devices`, attending with `attention`);
        a given one brings its own mesh and adapter slots (tests drive the host side with a scripted one).
        `progress`: a progress bar while the weights load."""
        head = None
        if runner is None and config.speculation.method == "eagle3":  # its KV: one more layer of the cache
            head = load_eagle3_head(config.speculation.model, model.config)
            model = dataclasses.replace(
                model, config=dataclasses.replace(model.config, draft_layer=head.name)
            )
        self.model = model
        self.tokenizer = model.tokenizer
        if runner is None:
            runner = self._build_runner(model, config, devices, attention, progress, head)
        self.runner, self.mesh, self.lora_slots = runner, runner.mesh, runner.lora
        self.config = config = runner.config
        self.loras = AdapterRegistry(
            model.config, config.max_lora_rank, self.lora_slots is not None, config.max_cpu_loras
        )
        ring_blocks = KVGroups.of(model.config).ring_blocks(config.block_size, config.max_num_batched_tokens)
        self.scheduler = Scheduler(
            config,
            self.lora_slots,
            windowed_transfers=bool(model.config.layer_windows),
            release_window=model.config.widest_window,
            ring_blocks=ring_blocks,
        )
        if getattr(runner, "host", None) is not None:  # the host tier's copies, before each cache write
            runner.before_write = self._move_host_blocks
        # an EAGLE-3 head's passes between steps; None: no head
        draft = getattr(runner, "draft", None)  # (a scripted runner has none)
        self.drafter = None if draft is None else DraftRunner(runner, self.scheduler)
        self._streams: dict[str, OutputStream] = {}
        self._ids = itertools.count()
        # The last step found nothing to run: queued requests wait for blocks or slots, and only a command
        # (an abort, arriving KV, a new request) can change that. The engine thread may sleep until one.
        self.stalled = False
        self._stepping: dict[str, Request] = {}  # the requests of the step under way (fail_step ends them)
        # host tier loads under way: (request id, its number in Scheduler.loading, the load)
        self._loads: list[tuple[str, int, HostLoad]] = []
        self._outputs = EngineOutputs()  # what commands and the step under way produced, for step()
        self._utilities = {
            "add_adapter": self.loras.add,
            "remove_adapter": self.loras.remove,
            "list_adapters": self.adapter_states,
            "stats": self.stats,
            "record_kv_events": self.record_kv_events,
        }

    @staticmethod
    def _build_runner(
        model: LoadedModel,
        config: EngineConfig,
        devices: Sequence[jax.Device] | None,
        attention: AttentionFn | None,
        progress: bool,
        head: Eagle3Head | None = None,
    ) -> ModelRunner:
        """The device side: the mesh, the weights on it, the adapter slots, the cache and the attention (on
        a TPU jax's Pallas kernel over this mesh where it applies, else the reference), and a draft head's
        weights."""
        rss_at_start = memory.resident_bytes()
        mesh = make_mesh(config.tp, devices)
        platform = mesh.devices.flat[0].platform
        config = config.on_platform(platform)  # "auto" dtype resolved
        if attention is None:
            attention = ragged_paged_attention_reference
            unsupported = platform == "tpu" and kernel_unsupported(
                model.config, config.tp, config.dtype, config.cache_dtype
            )
            if unsupported:
                log.warning("TPU attention kernel not used (%s): the reference attends", unsupported)
            elif platform == "tpu":
                attention = kernel_attention(model.config, mesh)
        dtype = jax.numpy.dtype(config.dtype)
        if config.quantization != "none" and (model.config.num_experts or model.config.is_mla):
            raise UnsupportedModelError(
                f"--quantization {config.quantization}: mixture-of-experts and MLA models are served "
                "unquantized (--quantization none)"
            )
        memory.model_len(model.config, config)  # refused before the weights load: a length past the model's,
        memory.check_weights_fit(model.config, config, mesh, model.checkpoint.num_params)  # weights too large
        if config.kv_offloading_size:
            _check_host_tier(model.config, config)
        weights = build_weights(model.config, model.checkpoint, mesh, dtype, progress, config.quantization)
        lora_slots = None
        if config.max_loras and (model.config.num_experts or model.config.is_mla):
            raise ValueError(
                "LoRA adapters on mixture-of-experts or MLA models are not supported (max_loras > 0)"
            )
        if config.max_loras:
            lora_slots = LoraSlots(model.config, config.max_loras, config.max_lora_rank, mesh, dtype)
        lora_weights = None if lora_slots is None else lora_slots.weights
        draft = None
        if head is not None:
            if multihost.is_multi_process():
                raise UnsupportedModelError("an EAGLE-3 head in a multi-host group is not supported")
            draft = DraftModel.build(head, mesh, dtype)
        temps = functools.partial(
            step_temps,
            model.config,
            mesh=mesh,
            weights=weights,
            lora_weights=lora_weights,
            attention=attention,
        )
        resident = (weights, lora_weights, None if draft is None else draft.weights)
        config, plan = memory.plan(model.config, config, mesh, resident, temps, rss_at_start)
        runner = ModelRunner(model.config, config, weights, mesh, lora_slots, attention, draft)
        runner.memory = plan
        return runner

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
        engine = cls(load_model(ref), config or EngineConfig(), devices, progress=progress)
        loaded = time.perf_counter()
        if warmup:
            engine.runner.warmup(progress=progress)
        engine.log_summary(load_s=f"{loaded - t0:.1f}", warmup_s=f"{time.perf_counter() - loaded:.1f}")
        return engine

    def summary(self) -> dict[str, str]:
        """What this engine runs on, in one place (the start-up line, Admin stats, /metrics' engine info):
        the model, platform, devices and mesh, dtype, weights per device, KV blocks and tokens, the maximum
        concurrency at max_model_len, the compile cache (engine.memory.MemoryPlan)."""
        plan = getattr(self.runner, "memory", None)  # (a scripted runner's: none)
        return {
            "model": self.model.config.name,
            **(plan.summary() if plan is not None else {}),
            "tp": str(self.config.tp),
            "quantization": self.config.quantization,
            "compile_cache": cache_state(),
        }

    def log_summary(self, **extra: str) -> None:
        """The start-up line: summary() and `extra` (load and warmup times) as key=value pairs."""
        fields = {**self.summary(), **extra}.items()
        log.info("engine: %s", " ".join(f"{k}={v!r}" if " " in v else f"{k}={v}" for k, v in fields))

    # ---- requests -------------------------------------------------------------------------------------
    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: str | None = None,
        lora_fingerprint: str | None = None,
        seed: int | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Validates and tokenizes (a text prompt gets the model's special tokens, its BOS, as vLLM and
        transformers add them; token ids are taken as they are); raises InvalidRequestError naming the bad
        field.

        `lora`: the adapter's name (None: the base model); with `lora_fingerprint` (a peer's copy of the
        adapter) the adapter loaded here must have the same weights (AdapterMismatchError otherwise).
        `seed`: the resolved seed a peer drew (default: params.seed, else a random one).
        `cache_salt`: the tenant's salt (Request.cache_salt; None or empty: unsalted).
        """
        if cache_salt is not None and len(cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters")
        vocab = self.model.config.vocab_size
        params.validate(vocab, self.config.max_logprobs)
        if isinstance(prompt, str):
            if len(prompt) > self.config.max_prompt_chars:  # refuse before spending CPU on tokenizing it
                raise InvalidRequestError("prompt", f"longer than {self.config.max_prompt_chars} characters")
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)  # its BOS, as vLLM's
        else:
            prompt_ids = [int(t) for t in prompt]
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise InvalidRequestError("prompt_token_ids", f"token ids must be in [0, {vocab})")
        if not prompt_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if params.prompt_logprobs is not None:  # (each of the n sequences' first output carries them)
            entries = len(prompt_ids) * (params.prompt_logprobs + 1) * params.n
            if entries > MAX_PROMPT_LOGPROB_ENTRIES:
                raise InvalidRequestError(
                    "prompt_logprobs",
                    f"{len(prompt_ids)} prompt tokens x {params.prompt_logprobs + 1} logprobs x "
                    f"n={params.n}: the limit is {MAX_PROMPT_LOGPROB_ENTRIES} entries",
                )
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(
                "n", f"{params.n} sequences: max_num_seqs ({self.config.max_num_seqs}) decode together"
            )
        if len(prompt_ids) + params.max_tokens > self.config.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model length {self.config.max_model_len}",
            )
        if seed is None:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
        allowed_mask = None
        if params.allowed_token_ids:  # once a request (its forks share it), its ids sorted without repeats
            unique = np.unique(np.asarray(params.allowed_token_ids, np.int64))
            params = dataclasses.replace(params, allowed_token_ids=tuple(unique.tolist()))
            allowed_mask = token_mask(unique, vocab).view(np.uint32)
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer is not None:  # (a bare model in tests has none)
            stop_ids |= self.tokenizer.eos_token_ids
        request = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=prompt_ids,
            params=params,
            seed=seed,
            lora=None if lora is None else self.loras.resolve(lora, lora_fingerprint),
            matcher=None if params.constraint is None else self.constraints.matcher(params.constraint),
            stop_token_ids=stop_ids,
            cache_salt=cache_salt or None,
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(prompt_ids),
            bad_word_ids=self._bad_word_ids(params.bad_words),
            allowed_mask=allowed_mask,
            reasoning=bool(params.reasoning_end) and params.constraint is not None,
        )
        if self.config.enable_prefix_caching:  # off the engine thread: a Preparer's (services.prepare)
            request.extend_block_hashes(self.config.block_size)
        return request

    def _bad_word_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens, as given (its leading spaces dropped) and after a space (vLLM's two
        spellings of a word at a text's start and inside it), without repeats."""
        spellings = {
            tuple(self.tokenizer.encode(text)) for w in words for text in (w.lstrip(), " " + w.lstrip())
        }
        return tuple(sorted(s for s in spellings if s))

    @functools.cached_property
    def constraints(self) -> ConstraintCompiler:
        """The constraint compiler for this model's tokenizer (built at the first constrained request)."""
        return ConstraintCompiler(self.tokenizer, self.model.config.vocab_size)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs) -> str:
        return self.add_prepared_request(self.make_request(prompt, params or SamplingParams(), **kwargs))

    def add_prepared_request(self, request: Request) -> str:
        """Queues a request built by make_request."""
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        self._streams[request.request_id] = OutputStream(request, self.tokenizer)
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, error: str = "") -> bool:
        """Cancels a request in any state, frees its blocks and forgets its transfer state; False when it
        is not (or no longer) here. `reason`: ABORT, or ERROR (fail_step; `error` says what failed).

        Idempotent; on the engine thread it runs after every command submitted before it, so a request
        added by a command still in flight when its caller was cancelled is removed too."""
        for key in [k for k in self._streams if k == request_id or k.startswith(f"{request_id}#")]:
            del self._streams[key]  # (its forked sequences' too)
        self.kv_connector.forget(request_id)
        return self.scheduler.abort(request_id, reason, error) is not None

    # ---- the daemons' boundary (engine.boundary) ------------------------------------------------------
    def apply(self, command: Command):
        """Runs one command (engine thread); returns its result (see each command)."""
        match command:
            case AddRequest(request=request, kv=kv, max_waiting=max_waiting):
                if max_waiting is not None and len(self.scheduler.waiting) >= max_waiting:
                    raise QueueFull(f"admission queue full ({max_waiting})")
                self.add_prepared_request(request)
                if kv is not None:
                    self.kv_connector.expect(request.request_id, kv)
                return request.request_id
            case Abort(request_id=request_id):
                return self.abort(request_id)
            case InsertKV():
                return self._insert_kv(command)
            case RemoteKVDone():
                return self._remote_kv_done(command)
            case RemoteKVFailed(request_id=request_id):
                return self.scheduler.remote_kv_failed(request_id)
            case Utility(method=method, args=args):
                return self._utilities[method](*args)
        raise TypeError(f"not an engine command: {command!r}")

    def stats(self) -> EngineStats:
        """A snapshot of the blocks, queues and adapters (engine thread)."""
        s, kv = self.scheduler, self.scheduler.kv
        running = [*s.running, *s.prefilling, *s.remote]
        slots = self.lora_slots

        def adapters(requests) -> tuple[str, ...]:
            return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))

        return EngineStats(
            num_running=len(running),
            num_waiting=len(s.waiting),
            num_incoming=len(s.remote),
            num_blocks=kv.pool.num_blocks,
            num_used_blocks=kv.pool.num_used,
            num_free_blocks=kv.pool.num_free,
            num_cached_blocks=kv.pool.num_cached,
            block_size=self.config.block_size,
            cache_dtype=self.kv_layout.dtype,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            prefix_cache_evictions=kv.pool.num_evictions,
            num_preemptions=s.num_preemptions,
            num_host_blocks=kv.host.num_slots if kv.host else 0,
            num_host_cached_blocks=kv.host.num_cached if kv.host else 0,
            num_host_staged_blocks=kv.host.num_staged if kv.host else 0,
            prefix_cache_host_hits=kv.stats.host_hits,
            num_host_offloads=self.runner.host.num_offloaded if kv.host else 0,
            running_adapters=adapters(running),
            waiting_adapters=adapters(s.waiting),
            max_loras=self.config.max_loras,
            num_adapters_loaded=len(self.loras.adapters),
            num_lora_slots_used=len(slots.resident) if slots else 0,
            num_lora_slot_loads=slots.num_loads if slots else 0,
            speculation=s.speculation.snapshot() if s.proposer is not None else None,
        )

    def adapter_states(self) -> list[AdapterState]:
        """The loaded adapters by name, and whether each sits in a device slot."""
        resident = set(self.lora_slots.resident) if self.lora_slots is not None else set()
        return [AdapterState(a, a.key in resident) for _, a in sorted(self.loras.adapters.items())]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop -------------------------------------------------------------------------------------
    def step(self) -> EngineOutputs:
        """One model step for the scheduled requests (none when nothing can run); returns what it and the
        commands since the last step produced, and a stats snapshot."""
        return self.run_step(self.schedule_step())

    def schedule_step(self) -> SchedulerOutput | None:
        """step()'s first half: the scheduler admits and picks the rows (None: nothing can run). What
        admission produced (a ReceiveKV request's TransferReady) is ready at once (take_outputs), so a
        driver starts the transfer while the step computes."""
        self._stepping = {}
        if self.drafter is not None and self.drafter.arrivals:  # their first drafts, for this schedule
            self.drafter.arrive()
        if self._loads:
            self._finish_loads(wait=False)
        scheduled = self.scheduler.schedule()
        if scheduled is None and (self._loads or self.scheduler.kv.has_loads):  # only loads to wait for
            self._finish_loads(wait=True)
            scheduled = self.scheduler.schedule()
        self.stalled = scheduled is None
        if scheduled is not None:
            requests = self.scheduler.requests
            self._stepping = {row.request_id: requests[row.request_id] for row in scheduled.rows}
            self._stepping.update((r.request_id, r) for r in self.scheduler.sending)
        return scheduled

    def run_step(self, scheduled: SchedulerOutput | None) -> EngineOutputs:
        """step()'s second half: runs the rows, applies the results, hands the KV to the connector."""
        if scheduled is not None:
            start = time.perf_counter()
            sampled = self._execute(scheduled)
            if sampled:  # (sampling waited for the step's end: this is the step's time)
                self.scheduler.observe_step_time(scheduled, time.perf_counter() - start)
            updated = self.scheduler.update_from_output(scheduled, sampled)
            if self.drafter is not None:  # (before forks copy blocks and the connector reads the KV)
                self.drafter.after_step(scheduled, self._stepping)
            for request, run in updated:
                self._outputs.tokens.append(self._emit(request, run))
            self._copy_blocks()
            # the connector's worker side: the KV of prompts computed in part, then of finished ones
            for row in scheduled.rows:
                request = self.scheduler.requests.get(row.request_id)
                if not row.samples and request is not None and request.status is Status.RUNNING:
                    self.kv_connector.save_kv(
                        self.runner, request, self.scheduler.block_tables(request.request_id)
                    )
            for request in list(self.scheduler.sending):
                self.kv_connector.send_kv(
                    self.runner, request, self.scheduler.block_tables(request.request_id)
                )
                self.scheduler.finish_sending(request.request_id)
            if self.scheduler.kv.host is not None:
                self._move_host_blocks()
        self._stepping = {}
        return self.take_outputs()

    def fail_step(self, reason: str) -> EngineOutputs:
        """After step() raised: ends the requests of that step (their state may be half updated; those it
        finished already never had their outputs returned) with FinishReason.ERROR, freeing what they
        still hold; returns their last outputs (with whatever else was produced before). The other
        requests are untouched."""
        for request_id, request in self._stepping.items():
            error = request.error or f"the step failed: {reason}"
            if not self.abort(request_id, FinishReason.ERROR, error):  # it finished in the step
                self.scheduler.finish(request, FinishReason.ERROR, error)
            self._outputs.tokens.append(RequestOutput.failed(request))
        self._stepping = {}
        return self.take_outputs()

    def take_outputs(self) -> EngineOutputs:
        """What the commands since the last step produced (a remote request's first token, transfers ready),
        without a step: a driver hands them out at once rather than after the next step's compute."""
        outputs, self._outputs = self._outputs, EngineOutputs()
        for item in self.kv_connector.take_outputs():
            (outputs.transfers if isinstance(item, TransferReady) else outputs.kv).append(item)
        outputs.stats = self.stats()
        outputs.kv_events = self.scheduler.kv.take_events()
        return outputs

    def _execute(self, scheduled: SchedulerOutput) -> dict[str, list[SampledToken]]:
        """Runs the step's rows; scores the prompt tokens of requests that ask for prompt logprobs; samples
        the rows that end their request's uncomputed tokens (a row with drafts: after its last token and
        after each draft, then engine.core.speculation.accept). Returns each sampling row's run of tokens."""
        logits = self.runner.forward(scheduled.rows)
        self._score_prompts(scheduled)
        starts = scheduled.logits_starts()
        # one sample per logits row of a sampling row: (request, the drafts before it, its logits row)
        samples: list[tuple[Request, list[int], int]] = []
        runs: dict[str, list[int]] = {}  # request id -> indices of its samples, by position
        forked: dict[str, list[Request]] = {}  # a first token with n > 1: n samples of the same logits
        for row, start in zip(scheduled.rows, starts, strict=True):
            if not row.samples:
                continue
            request = self.scheduler.requests[row.request_id]
            runs[request.request_id] = list(range(len(samples), len(samples) + row.num_logits))
            samples += [(request, row.drafts[:j], start + j) for j in range(row.num_logits)]
            if request.forks_pending:
                forked[request.request_id] = self._forks(request)
                for child in forked[request.request_id]:
                    runs[child.request_id] = [len(samples)]
                    samples.append((child, [], start))
        if not samples:
            return {}
        sample_rows = [
            SampleRow(r.params, r.seed, r.num_tokens + len(d), r.prompt_ids, r.output_ids + d)
            for r, d, _ in samples
        ]
        allowed = self._allowed_tokens([(r, d) for r, d, _ in samples])  # on the host while the device runs
        result = self.runner.sample(logits, sample_rows, [i for _, _, i in samples], allowed)
        out = {}
        for rid, indices in runs.items():
            request, drafts = samples[indices[0]][0], samples[indices[-1]][1]
            emitted = accept(drafts, result.tokens[indices].tolist())
            out[rid] = self._sampled_run(request, emitted, result, indices, allowed)
        for rid, children in forked.items():
            forks = tuple((c, out.pop(c.request_id)[0]) for c in children)
            out[rid][0] = dataclasses.replace(out[rid][0], forks=forks)
        return out

    def _sampled_run(
        self,
        request: Request,
        emitted: list[int],
        result: SampleResult,
        indices: list[int],
        allowed: np.ndarray | None,
    ) -> list[SampledToken]:
        """The tokens a sampling row emits (`emitted`: its i-th from sample indices[i]) through the
        request's constraint, with their logprobs: up to one the constraint ends the request at."""
        run = []
        for token, i in zip(emitted, indices, strict=False):
            logprobs, finish = None, None
            try:
                token, finish = self._constrain(request, token, None if allowed is None else allowed[i])
                if request.params.logprobs is not None:
                    n = request.params.logprobs
                    top = list(
                        zip(result.top_ids[i, :n].tolist(), result.top_logprobs[i, :n].tolist(), strict=True)
                    )
                    logprobs = TokenLogprobs(token, float(result.logprob[i]), top)
            except Exception as e:  # noqa: BLE001 - pinned to this request
                run.append(SampledToken(token, None, FinishReason.ERROR, _failure(request, "sampling", e)))
                return run
            run.append(SampledToken(token, logprobs, finish))
            if finish is not None:
                return run
        return run

    def _forks(self, request: Request) -> list[Request]:
        """Sequences 1..n-1 of a request about to sample its first token (each with its own detokenizer
        and matcher); the scheduler adopts them with their first tokens."""
        children, constraint = [], request.params.constraint
        for index in range(1, request.params.n):
            matcher = None if constraint is None else self.constraints.matcher(constraint)
            children.append(request.fork(index, matcher))
            self._streams[children[-1].request_id] = OutputStream(children[-1], self.tokenizer)
        return children

    def _move_host_blocks(self) -> None:
        """The host tier's copies owed (engine.core.kv_cache_manager), started: run before every write of
        the cache (ModelRunner.before_write), and after each step to take the copies that landed. Loads
        read their slots first (an offload landing may reuse one); evicted blocks are read before the
        write that called this."""
        kv = self.scheduler.kv
        for request_id, pairs in kv.take_loads():  # (admitted in the last schedule)
            number = self.scheduler.loading.get(request_id)
            if number is not None:  # (None: it ended before its load started: its blocks are freed)
                self._loads.append((request_id, number, self.runner.start_load(pairs)))
        kv.offloads_landed(self.runner.copy_out(kv.take_offloads()))

    def _finish_loads(self, wait: bool) -> None:
        """Writes the host tier loads whose bytes are on the devices (all of them with `wait`: nothing
        else can run) into their blocks; their requests may be scheduled now. A request that ended
        meanwhile gets nothing written (its blocks may be another's)."""
        self._move_host_blocks()
        pending, done = [], []
        for request_id, number, load in self._loads:
            if not (wait or load.ready):
                pending.append((request_id, number, load))
                continue
            if self.scheduler.loading.get(request_id) == number:
                self.runner.finish_load(load)
            done.append((request_id, number))
        self._loads = pending
        self.scheduler.kv_loaded(done)

    def _copy_blocks(self) -> None:
        """Makes the block copies forks asked for, before a step writes into them."""
        copies = self.scheduler.take_block_copies()
        if copies:
            self.runner.copy_blocks(copies)

    def _score_prompts(self, scheduled: SchedulerOutput) -> None:
        """The step's prompt positions of requests with prompt_logprobs: each position's logits score the
        prompt's next token (Request.prompt_logprobs[p + 1]), with its rank and the top n."""
        targets, places, start = None, [], 0
        for row in scheduled.rows:
            request = self.scheduler.requests[row.request_id]
            prompt = request.prompt_ids
            if request.prompt_logprobs is not None and row.num_past < len(prompt) - 1:
                if targets is None:
                    num_tokens = sum(len(r.tokens) for r in scheduled.rows)  # padded as the step was
                    targets = np.full(bucket_for(num_tokens, self.config.token_buckets), -1, np.int32)
                for j in range(min(len(row.tokens), len(prompt) - 1 - row.num_past)):
                    targets[start + j] = prompt[row.num_past + j + 1]
                    places.append((request, row.num_past + j + 1, start + j))
            start += len(row.tokens)
        if targets is None:
            return
        scores = self.runner.prompt_scores(targets)
        for request, position, i in places:
            n = request.params.prompt_logprobs
            top = list(zip(scores.top_ids[i, :n].tolist(), scores.top_logprobs[i, :n].tolist(), strict=True))
            logprob, rank = float(scores.logprob[i]), int(scores.rank[i])
            request.prompt_logprobs[position] = TokenLogprobs(int(targets[i]), logprob, top, rank)

    def _allowed_tokens(self, samples: list[tuple[Request, list[int]]]) -> np.ndarray | None:
        """The samples' allowed-token bitmasks (all ones where unconstrained and not held); None: every
        token, every sample. A sample is a request's next token after `drafted` (its drafts before that
        position; none without speculation). A constraint's mask is narrowed to the request's
        allowed_token_ids, then its bad words' next tokens are banned; a sample short of its min_tokens has
        its stop tokens held back, unless that would leave nothing (a constraint that allows only EOS ends
        it as a dead end)."""
        outputs = [r.output_ids + drafted for r, drafted in samples]
        rows = [i for i, (r, _) in enumerate(samples) if r.matcher is not None and not r.reasoning]
        narrowed = [i for i, (r, _) in enumerate(samples) if r.allowed_mask is not None or r.bad_word_ids]
        held = [
            i
            for i, (r, _) in enumerate(samples)
            if len(outputs[i]) < r.params.min_tokens and r.stop_token_ids
        ]
        if not rows and not held and not narrowed:
            return None
        vocab = self.model.config.vocab_size
        allowed = np.full((len(samples), mask_words(vocab)), -1, np.int32)
        first = [i for i in rows if not samples[i][1]]  # at the matcher's own position: filled together
        allowed[first] = self.constraints.fill([samples[i][0].matcher for i in first])
        for i in rows:
            if samples[i][1]:
                allowed[i] = self._drafted_mask(samples[i][0], samples[i][1], allowed[i - 1])
        for i in narrowed:
            request, row = samples[i][0], allowed[i].view(np.uint32)
            if request.allowed_mask is not None:
                row &= request.allowed_mask
            output = outputs[i]
            banned = [  # each bad word's last token, where the output ends with the rest of the word
                word[-1]
                for word in request.bad_word_ids
                if len(word) <= len(output) + 1 and output[len(output) + 1 - len(word) :] == list(word[:-1])
            ]
            row[:] = _without(row, banned)
        for i in held:
            allowed[i] = _without(allowed[i].view(np.uint32), samples[i][0].stop_token_ids).view(np.int32)
        return allowed

    def _drafted_mask(self, request: Request, drafted: list[int], previous: np.ndarray) -> np.ndarray:
        """The constraint's mask after the request's output and `drafted`, its drafts before this position
        (the mask before, `previous`, is the one after drafted[:-1]): the matcher advanced through the
        drafts, then rolled back. Where a draft is refused, `previous`: the sample there is then never
        accepted (it would have to equal the refused draft), so no later position's mask is used."""
        matcher = request.matcher
        consumed = matcher.try_consume_tokens(drafted)
        if consumed < len(drafted):
            matcher.rollback(consumed)
            return previous
        try:
            return self.constraints.fill([matcher])[0]
        finally:
            matcher.rollback(len(drafted))

    def _constrain(
        self, request: Request, token: int, allowed: np.ndarray | None = None
    ) -> tuple[int, FinishReason | None]:
        """A sampled token (`allowed`: the mask it was sampled under; None: it was sampled elsewhere) through
        the request's constraint, if it has one: see _advance_constraint. While the output is still the
        model's reasoning, the token only ends it when it completes params.reasoning_end."""
        if request.matcher is None:
            return token, None
        if request.reasoning:
            end = request.params.reasoning_end
            request.reasoning = [*request.output_ids, token][-len(end) :] != list(end)
            return token, None
        if allowed is None:
            return token, self._consume(request, token)
        return self._advance_constraint(request, token, allowed)

    def _advance_constraint(
        self, request: Request, token: int, allowed: np.ndarray
    ) -> tuple[int, FinishReason | None]:
        """Advances the request's matcher with its sampled token (which `allowed`, its mask, let through);
        returns the token and how it ends the request, if it does. An empty mask (the constraint allows
        nothing more) ends the request instead: its token becomes EOS, never shown."""
        if not allowed.any():
            return min(self.tokenizer.eos_token_ids, default=0), FinishReason.DEAD_END
        return token, self._consume(request, token)

    def _consume(self, request: Request, token: int) -> FinishReason | None:
        """The request's matcher takes `token`; returns how that ends the request, if it does. One it
        refuses (a work limit reached inside the matcher, or the EOS a prefill server sends for a dead end
        at the first token) is a dead end: nothing after the last token the constraint took is shown."""
        if not request.matcher.consume_token(token):
            log.warning(
                "constraint failed at token %d: %s",
                token,
                request.matcher.get_error(),
                extra={"request_id": request.request_id},
            )
            return FinishReason.DEAD_END
        if request.matcher.is_stopped() and token in self.tokenizer.eos_token_ids:  # ignore_eos or not
            return FinishReason.STOP  # complete (a complete output allows only EOS next)
        return None

    def _emit(self, request: Request, run: list[SampledToken]) -> RequestOutput:
        """The client's view of the tokens the scheduler appended: detokenized, stop strings checked (a match
        is reported to the scheduler, which finishes the request there: tokens of the run after it go); a
        finished request's stream ends."""
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        output = None
        if request.finish_reason is not FinishReason.ERROR:
            try:
                output = self._streams[request.request_id].on_tokens(
                    [t.token for t in run], [t.logprobs for t in run]
                )
            except Exception as e:  # noqa: BLE001 - pinned to this request
                self.scheduler.finish(request, FinishReason.ERROR, _failure(request, "detokenizing", e))
            else:
                cut = output.num_output_tokens < len(request.output_ids)
                if output.finish_reason is not request.finish_reason or cut:  # a stop string matched
                    self.scheduler.finish(request, output.finish_reason, num_output=output.num_output_tokens)
        if request.finish_reason is FinishReason.ERROR:
            output = RequestOutput.failed(request)
        if output.finished:
            self._streams.pop(request.request_id, None)
            output.draft_aux = request.draft_aux  # (a prefill server's: engine.draft_runner)
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
        """Starts keeping KV cache events (the first: AllBlocksCleared): each step's outputs carry those
        since the step before."""
        self.scheduler.kv.record_events()

    # ---- KV from elsewhere (see engine.core.kv_connector) ----------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        """This engine's cache as kvtransfer sees it (what a Handshake compares): its runner's."""
        return self.runner.layout

    @property
    def kv_connector(self) -> KVConnector:
        return self.scheduler.connector

    def set_kv_connector(self, connector: KVConnector) -> None:
        """Installs the connector of this engine's role (before any request is added)."""
        if self.scheduler.requests:
            raise RuntimeError("a KV connector is installed before requests are added")
        self.scheduler.connector = connector

    def _remote_kv_done(self, done: RemoteKVDone) -> None:
        """The request starts decoding on its first token (its constraint's matcher advanced by it); the
        token's output is among the next outputs (take_outputs). KVInsertError when an insert of that
        transfer failed here."""
        error = self.kv_connector.take_insert_failure(done.request_id, done.transfer)
        if error is not None:
            raise KVInsertError(f"inserting the KV failed here: {error}")
        request = self.scheduler.requests[done.request_id]
        request.num_cached_tokens = done.num_cached_tokens
        if done.prompt_logprobs is not None and request.prompt_logprobs is not None:
            request.prompt_logprobs = [None, *done.prompt_logprobs]
        if len(done.forks) != (request.params.n - 1 if request.forks_pending else 0):
            raise ValueError(f"{len(done.forks)} forked first tokens for a request of n={request.params.n}")
        forks = []
        for child, (fork_token, fork_logprobs) in zip(self._forks(request), done.forks, strict=True):
            _, child_finish = self._constrain(child, fork_token)
            forks.append((child, SampledToken(fork_token, fork_logprobs, child_finish)))
        _, finish = self._constrain(request, done.token)
        if self.drafter is not None and done.draft_aux is not None:  # drafted from before the next schedule
            request.draft_aux = done.draft_aux
            self.drafter.arrivals.append(request)
        token = SampledToken(done.token, done.logprobs, finish, forks=tuple(forks))
        for started, first in self.scheduler.remote_kv_arrived(done.request_id, token):
            self._outputs.tokens.append(self._emit(started, first))
        self._copy_blocks()

    def _insert_kv(self, insert: InsertKV) -> bool:
        """Writes one arriving KV chunk into the request's blocks; False (nothing written) when the request
        no longer waits for KV (aborted meanwhile) or the write failed (kept for its RemoteKVDone)."""
        request = self.scheduler.requests.get(insert.request_id)
        if request is None or request.status is not Status.WAITING_FOR_REMOTE_KV:
            return False
        blocks = self.scheduler.block_tables(insert.request_id)[insert.first_block :]
        try:
            self.kv_connector.load_kv(self.runner, blocks, insert.chunk)
        except Exception as e:  # noqa: BLE001 - pinned to this transfer
            log.exception("KV insert failed", extra={"request_id": insert.request_id})
            self.kv_connector.insert_failed(insert.request_id, insert.transfer, f"{type(e).__name__}: {e}")
            return False
        return True

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
        cache_salt: str | None = None,
    ) -> list[FinishedSequence]:
        """Runs prompts to completion together (continuous batching); results in prompt order, and a
        prompt's n sequences (SamplingParams.n) in index order.

        `lora`: one adapter name for all prompts, or one per prompt (None: the base model). `cache_salt`:
        the tenant's prefix-cache salt for all of them (None: unsalted)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if lora is None or isinstance(lora, str):
            lora = [lora] * len(prompts)
        ids = [
            self.add_request(p, sp, lora=name, cache_salt=cache_salt)
            for p, sp, name in zip(prompts, params, lora, strict=True)
        ]
        done: dict[tuple[str, int], FinishedSequence] = {}
        for rid, sp in zip(ids, params, strict=True):
            for index in range(sp.n):
                prompt_ids = self.scheduler.requests[rid].prompt_ids
                done[rid, index] = FinishedSequence(rid, prompt_ids, [], "", None, index=index)
        while any(c.finish_reason is None for c in done.values()):
            for output in self.step().tokens:
                completion = done.get((output.request_id, output.index))
                if completion is None:
                    continue
                completion.token_ids += output.new_token_ids
                completion.text += output.text
                completion.logprobs += output.logprobs
                completion.num_cached_tokens = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    completion.prompt_logprobs = output.prompt_logprobs
                if output.finished:
                    completion.finish_reason = output.finish_reason.value
        return list(done.values())


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
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with SamplingParams.prompt_logprobs
    index: int = 0  # which of the prompt's n sequences


def _check_host_tier(model: ModelConfig, config: EngineConfig) -> None:
    """--kv-offloading-size's refusal (a multi-host group), before the weights load; where there is no
    prefix cache (hybrid models, --no-prefix-caching) the tier only stages a prefill server's streams."""
    flag = f"--kv-offloading-size {config.kv_offloading_size:g}"
    if multihost.is_multi_process():
        raise UnsupportedModelError(
            f"{flag}: a multi-host group does not offload yet (each host would copy its own shards)"
        )
    if not config.enable_prefix_caching or not KVGroups.of(model).is_identity:
        why = "--no-prefix-caching" if not config.enable_prefix_caching else "a hybrid model's layer groups"
        log.warning("%s: no prefix cache (%s) to offload: the tier only stages prefill streams", flag, why)


def _without(row: np.ndarray, tokens) -> np.ndarray:
    """A copy of the bitmask `row` (uint32 words) with `tokens` cleared; `row` itself when that would
    leave no token at all (what a ban or a hold-back must not do)."""
    out = row.copy()
    for token in tokens:
        out[token // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (token % 32)))
    return out if out.any() else row


def _failure(request: Request, what: str, error: Exception) -> str:
    """A failure pinned to one request (its matcher, its detokenizer, its stop strings): logged; the text
    its FinishReason.ERROR carries. The batch goes on."""
    log.exception("%s failed", what, extra={"request_id": request.request_id})
    return f"{what}: {type(error).__name__}: {error}"
