"""The engine core: one model on one mesh, continuous batching, driven by typed commands.

The daemons drive it through `apply(command)` (engine.boundary) and read what each `step()` returns
(EngineOutputs): nothing else crosses, besides `make_request` (engine.input_processor: safe off the
engine thread) and the read-only facts of `summary()`, `kv_layout` and `adapter_names()`. One step
reads in three calls: schedule -> execute -> update.

Where each job lives:
  engine.builder          the device side: mesh, weights, adapter slots, attention, memory plan, runner
  engine.input_processor  prompt + parameters -> a validated Request
  engine.core.scheduler   every request's state and blocks; what a step's results change
  engine.executor         a scheduled step on the device -> each row's sampled tokens
  engine.token_masks      the allowed-token masks before sampling, constraints after
  engine.core.output      tokens -> the client's view (text, stop strings), the scheduler's output sink
  engine.draft_runner     an EAGLE-3 head's passes between steps
  engine.host_tier        the host-memory KV tier's copies and loads
  engine.offline          generate() and prompt_logits(), for scripts and tests
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import jax

from pdserve import kvtransfer
from pdserve.engine.boundary import (
    Abort,
    AdapterState,
    AddRequest,
    Command,
    Detach,
    DetachedSequence,
    EngineOutputs,
    EngineStats,
    ExportKV,
    InsertKV,
    KVInsertError,
    QueueFull,
    Reattach,
    RemoteKVDone,
    RemoteKVFailed,
    Utility,
)
from pdserve.engine.builder import build_runner
from pdserve.engine.compile_cache import cache_state
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_connector import KVConnector, PrefillConnector, TransferReady
from pdserve.engine.core.kv_groups import KVGroups
from pdserve.engine.core.output import OutputStreams, RequestOutput
from pdserve.engine.core.request import FinishReason, Request, Status
from pdserve.engine.core.scheduler import SampledToken, Scheduler, SchedulerOutput
from pdserve.engine.draft_runner import DraftRunner
from pdserve.engine.executor import StepExecutor
from pdserve.engine.host_tier import HostTier
from pdserve.engine.input_processor import InputProcessor
from pdserve.engine.loading.eagle3 import load_eagle3_head
from pdserve.engine.loading.sources import LoadedModel, load_model
from pdserve.engine.lora import AdapterRegistry, LoraAdapter
from pdserve.engine.model.attention import AttentionFn
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.multihost import Publish, is_multi_process
from pdserve.engine.offline import OfflineAPI
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.token_masks import TokenMasks
from pdserve.kvtransfer import KVChunk, KVLayout

log = logging.getLogger(__name__)


class LLMEngine(OfflineAPI):
    """Continuous batching over one model on one mesh. Not thread-safe: drive it from one thread
    (make_request excepted). The offline API (generate, prompt_logits) comes from engine.offline."""

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        devices: Sequence[jax.Device] | None = None,
        attention: AttentionFn | None = None,
        runner: ModelRunner | None = None,
        progress: bool = False,
    ):
        """`runner`: the device side, built here by default (engine.builder: on `devices`, attending with
        `attention`, the default TPU kernel or the reference); a given one brings its own mesh and adapter
        slots (tests drive the host side with a scripted one). `progress`: a progress bar while the
        weights load."""
        if runner is None:
            head = None
            if config.speculation.method == "eagle3":  # its KV: one more layer of the cache
                head = load_eagle3_head(config.speculation.model, model.config)
                model = dataclasses.replace(
                    model, config=dataclasses.replace(model.config, draft_layer=head.name)
                )
            runner = build_runner(model, config, devices, attention, progress, head)
        self.model = model
        self.tokenizer = model.tokenizer
        self.runner, self.mesh, self.lora_slots = runner, runner.mesh, runner.lora
        self.config = config = runner.config
        self.loras = AdapterRegistry(
            model.config, config.max_lora_rank, self.lora_slots is not None, config.max_cpu_loras
        )
        self.masks = TokenMasks(self.tokenizer, model.config.vocab_size)
        self.inputs = InputProcessor(model.config, self.tokenizer, config, self.loras, self.masks)
        self.streams = OutputStreams(self.tokenizer)
        ring_blocks = KVGroups.of(model.config).ring_blocks(config.block_size, config.max_num_batched_tokens)
        self.scheduler = Scheduler(
            config,
            self.lora_slots,
            windowed_transfers=bool(model.config.layer_windows),
            release_window=model.config.widest_window,
            ring_blocks=ring_blocks,
            outputs=self.streams,
        )
        self.executor = StepExecutor(runner, self.scheduler, self.masks)
        # the host tier's copies and loads (None: no tier, or a scripted runner without a cache)
        self.host_tier = None
        if self.scheduler.kv.host is not None and getattr(runner, "cache", None) is not None:
            self.host_tier = HostTier(runner, self.scheduler)
        # an EAGLE-3 head's passes between steps; None: no head (a scripted runner has none)
        draft = getattr(runner, "draft", None)
        self.drafter = None if draft is None else DraftRunner(runner, self.scheduler, self.host_tier)
        # The last step found nothing to run: queued requests wait for blocks or slots, and only a command
        # (an abort, arriving KV, a new request) can change that. The engine thread may sleep until one.
        self.stalled = False
        self._stepping: dict[str, Request] = {}  # the requests of the step under way (fail_step ends them)
        self._step_outputs = 0  # where the step under way's outputs start in the streams' (fail_step)
        self._outputs = EngineOutputs()  # what commands and the step under way produced, for step()
        # the peer layouts whose KV frames this engine's inserts are compiled for (compile_inserts_from);
        # None until warmup_transfers: an engine that compiles on first use keeps doing so
        self._insert_layouts: set[tuple[str, int]] | None = None
        self._utilities = {
            "add_adapter": self.loras.add,
            "remove_adapter": self.loras.remove,
            "list_adapters": self.adapter_states,
            "stats": self.stats,
            "record_kv_events": self.record_kv_events,
        }

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
            engine.warmup(progress=progress)
        engine.log_summary(load_s=f"{loaded - t0:.1f}", warmup_s=f"{time.perf_counter() - loaded:.1f}")
        return engine

    def warmup(self, progress: bool = False) -> int:
        """Compiles every shape the engine's device work can take (steps, sampler, scores, copies, the
        host tier's copies); returns how many variants."""
        variants = self.runner.warmup(progress=progress)
        if self.host_tier is not None:
            variants += self.host_tier.warmup()
        return variants

    def warmup_transfers(
        self,
        max_frame_bytes: int = kvtransfer.MAX_FRAME_BYTES,
        head_map: kvtransfer.HeadMap | None = None,
        receiver: LLMEngine | None = None,
        insert: bool = True,
    ) -> int:
        """Compiles the KV transfers a daemon runs (engine.kv_io.RunnerKVIO.warmup_kv_io): every chunk shape
        of requests up to max_model_len in frames of `max_frame_bytes` (the wire's; a prefill's sent, a
        migration's either way), gathered here with `head_map` (heads converted to another layout) and,
        unless `insert` is False (a prefill server receives none), inserted into `receiver` (default: this
        engine, which gets back what it held). Before serving only. Returns the number of transfers run."""
        to = None if receiver is None else receiver.runner
        runs = self.runner.warmup_kv_io(
            self.kv_layout, self.config.max_model_len, max_frame_bytes, head_map, to, insert
        )
        if not insert:
            return runs
        inserted = receiver or self  # now compiled for this layout's frames
        inserted._insert_layouts = {
            *(inserted._insert_layouts or ()),
            (self.kv_layout.to_json(), max_frame_bytes),
        }
        return runs

    def compile_inserts_from(
        self, src: kvtransfer.KVLayout, max_frame_bytes: int = kvtransfer.MAX_FRAME_BYTES
    ) -> int:
        """Compiles, without running them, the inserts of the KV a peer of layout `src` sends in frames of
        `max_frame_bytes` (a prefill replica, a draining decode server): its frame plan cuts chunks of its
        own sizes (at another TP, its padded heads change the blocks a frame holds), which warmup_transfers
        did not compile here. Once per layout, and only once warmup_transfers ran (an engine that compiles
        on first use keeps doing so), in one process (a group's workers compile their inserts on first
        use). Safe off the engine thread: nothing runs. Returns the number of chunk shapes compiled (0: a
        layout met before, no warmup, or a process group)."""
        key = (src.to_json(), max_frame_bytes)
        if self._insert_layouts is None or key in self._insert_layouts or is_multi_process():
            return 0  # (a process group's workers insert too: they compile on first use)
        self._insert_layouts.add(key)
        return self.runner.compile_inserts(src, self.config.max_model_len, max_frame_bytes)

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
    def make_request(self, prompt: str | Sequence[int], params: SamplingParams, *args, **kwargs) -> Request:
        """A validated, tokenized request (engine.input_processor.InputProcessor.make_request: its
        arguments, its InvalidRequestError naming the field). Safe to call from any thread."""
        return self.inputs.make_request(prompt, params, *args, **kwargs)

    def adapter_names(self) -> tuple[str, ...]:
        """The names of the adapters loaded now, sorted (a snapshot; safe to call from any thread)."""
        return tuple(sorted(self.loras.adapters))

    def read_adapter(self, name: str, path: str) -> LoraAdapter:
        """Reads and checks a PEFT adapter folder for this model (file I/O: call it off the engine thread);
        Utility("add_adapter", (adapter,)) then serves it. LoraLoadError when it cannot be served."""
        return self.loras.read(name, path)

    @property
    def draft_aux_width(self) -> int:
        """The width of an EAGLE-3 head's input per position (the aux states a prefill server's trailer
        carries with the first token); 0: no head."""
        draft = getattr(self.runner, "draft", None)
        return 0 if draft is None else len(draft.aux_layers) * self.model.config.hidden_size

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs) -> str:
        return self.add_prepared_request(self.make_request(prompt, params or SamplingParams(), **kwargs))

    def add_prepared_request(self, request: Request) -> str:
        """Queues a request built by make_request."""
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, error: str = "") -> bool:
        """Cancels a request in any state (its forked sequences too), frees its blocks and forgets its
        transfer state; False when it is not (or no longer) here. `reason`: ABORT, or ERROR (fail_step;
        `error` says what failed).

        Idempotent; on the engine thread it runs after every command submitted before it, so a request
        added by a command still in flight when its caller was cancelled is removed too."""
        forks = [r.request_id for r in self.scheduler.requests.values() if r.parent_id == request_id]
        self.streams.drop([request_id, *forks])
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
            case Detach(request_id=request_id, export_kv=export_kv):
                detached = [_detached(r) for r in self.scheduler.detach(request_id)]
                if export_kv:
                    detached = [
                        dataclasses.replace(d, kv=self._export_kv(ExportKV(d.request_id))) for d in detached
                    ]
                return tuple(detached)
            case ExportKV():
                return self._export_kv(command)
            case Reattach(request_ids=request_ids):
                return self.scheduler.reattach(request_ids)
            case Utility(method=method, args=args):
                return self._utilities[method](*args)
        raise TypeError(f"not an engine command: {command!r}")

    def stats(self) -> EngineStats:
        """A snapshot of the blocks, queues and adapters (engine thread)."""
        s, kv = self.scheduler, self.scheduler.kv
        running = [*s.running, *s.prefilling, *s.remote, *s.detached]
        slots = self.lora_slots
        host = kv.host

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
            num_host_blocks=host.num_slots if host else 0,
            num_host_cached_blocks=host.num_cached if host else 0,
            num_host_staged_blocks=host.num_staged if host else 0,
            prefix_cache_host_hits=kv.stats.host_hits,
            num_host_offloads=self.host_tier.store.num_offloaded if self.host_tier else 0,
            running_adapters=adapters(running),
            waiting_adapters=adapters(s.waiting),
            max_loras=self.config.max_loras,
            num_adapters_loaded=len(self.loras.adapters),
            num_lora_slots_used=len(slots.resident) if slots else 0,
            num_lora_slot_loads=slots.num_loads if slots else 0,
            speculation=s.drafts.stats.snapshot() if s.drafts.proposer is not None else None,
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

    def synchronize(self) -> None:
        """Waits until the device has finished every step issued (a step that samples waits for its end
        already; one that only computes a prompt chunk does not): for timing steps to their end."""
        jax.block_until_ready(self.runner.cache)

    def schedule_step(self) -> SchedulerOutput | None:
        """step()'s first half: the scheduler admits and picks the rows (None: nothing can run). What
        admission produced (a ReceiveKV request's TransferReady) is ready at once (take_outputs), so a
        driver starts the transfer while the step computes."""
        self._stepping = {}
        if self.drafter is not None and self.drafter.arrivals:  # their first drafts, for this schedule
            drafts = self.drafter.arrive()
            self.scheduler.drafted(drafts.proposed, drafts.aux)
        host = self.host_tier
        if host is not None and host.has_loads:
            host.finish_loads(wait=False)
        scheduled = self.scheduler.schedule()
        if scheduled is None and host is not None and host.has_loads:  # only loads to wait for
            host.finish_loads(wait=True)
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
            self._start_host_copies()  # (admission may have evicted blocks the step overwrites)
            start = time.perf_counter()
            sampled = self.executor.execute(scheduled)
            if sampled:  # (sampling waited for the step's end: this is the step's time)
                num_tokens = sum(len(row.tokens) for row in scheduled.rows)
                self.scheduler.drafts.observe_step_time(num_tokens, time.perf_counter() - start)
            self._step_outputs = self.streams.num_pending
            self.scheduler.update_from_output(scheduled, sampled)
            if self.drafter is not None:  # (before forks copy blocks and the connector reads the KV)
                drafts = self.drafter.after_step(scheduled, self._stepping)
                self.scheduler.drafted(drafts.proposed, drafts.aux)
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
            self._start_host_copies()
        self._stepping = {}
        return self.take_outputs()

    def fail_step(self, reason: str) -> EngineOutputs:
        """After step() raised: ends the requests of that step (their state may be half updated; those it
        finished already never had their outputs returned) with FinishReason.ERROR, freeing what they
        still hold; returns their last outputs (with whatever else was produced before). The other
        requests are untouched."""
        self.streams.discard(self._stepping, since=self._step_outputs)  # (reported failed instead)
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
        outputs.tokens[:0] = self.streams.take()
        for item in self.kv_connector.take_outputs():
            (outputs.transfers if isinstance(item, TransferReady) else outputs.kv).append(item)
        outputs.stats = self.stats()
        outputs.kv_events = self.scheduler.kv.take_events()
        return outputs

    def _start_host_copies(self) -> None:
        """The host tier's copies owed (blocks evicted and handed out again, host hits admitted), started
        before the next write of the cache (engine.host_tier)."""
        if self.host_tier is not None:
            self.host_tier.start_copies()

    def _copy_blocks(self) -> None:
        """Makes the block copies forks asked for, before a step writes into them."""
        copies = self.scheduler.take_block_copies()
        if copies:
            self._start_host_copies()
            self.runner.copy_blocks(copies)

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

    def prefill_connector(self) -> PrefillConnector:
        """The prefill role's connector for this engine: its KV layout, and its host tier's slots to stage
        gathered KV in (None: no tier)."""
        return PrefillConnector(self.kv_layout, self.scheduler.kv.host)

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
        if done.token is None:  # a resumed request: it decodes on from its last output
            self.scheduler.remote_kv_arrived(done.request_id, None)
            return
        if len(done.forks) != (request.params.n - 1 if request.forks_pending else 0):
            raise ValueError(f"{len(done.forks)} forked first tokens for a request of n={request.params.n}")
        forks = []
        for child, (fork_token, fork_logprobs) in zip(self.executor.forks(request), done.forks, strict=True):
            _, child_finish = self.masks.advance(child, fork_token)
            forks.append((child, SampledToken(fork_token, fork_logprobs, child_finish)))
        _, finish = self.masks.advance(request, done.token)
        if self.drafter is not None and done.draft_aux is not None:  # drafted from before the next schedule
            self.drafter.arrivals.append((request, done.draft_aux))
        token = SampledToken(done.token, done.logprobs, finish, forks=tuple(forks))
        self.scheduler.remote_kv_arrived(done.request_id, token, done.num_cached_tokens, done.prompt_logprobs)
        self._copy_blocks()

    def _export_kv(self, export: ExportKV) -> tuple[KVChunk, ...]:
        """A detached sequence's KV from block `first_block` on, as kvtransfer chunks of this layout."""
        request = self.scheduler.requests.get(export.request_id)
        if request is None or request.status is not Status.DETACHED:
            raise ValueError(f"request {export.request_id!r} is not detached")
        num_tokens = request.num_computed - export.first_block * self.config.block_size
        if num_tokens <= 0:
            return ()
        plan = kvtransfer.plan_frames(self.kv_layout, num_tokens, export.max_frame_bytes)
        tables = self.scheduler.block_tables(request.request_id)[export.first_block :]
        chunks = self.runner.gather_kv(
            self.kv_layout,
            tables,
            num_tokens,
            max_frame_bytes=export.max_frame_bytes,
            head_map=None,
            frames=plan,
        )
        return tuple(chunks)

    def _insert_kv(self, insert: InsertKV) -> bool:
        """Writes one arriving KV chunk into the request's blocks; False (nothing written) when the request
        no longer waits for KV (aborted meanwhile) or the write failed (kept for its RemoteKVDone)."""
        request = self.scheduler.requests.get(insert.request_id)
        if request is None or request.status is not Status.WAITING_FOR_REMOTE_KV:
            return False
        blocks = self.scheduler.block_tables(insert.request_id)[insert.first_block :]
        self._start_host_copies()
        try:
            self.kv_connector.load_kv(self.runner, blocks, insert.chunk)
        except Exception as e:  # noqa: BLE001 - pinned to this transfer
            log.exception("KV insert failed", extra={"request_id": insert.request_id})
            self.kv_connector.insert_failed(insert.request_id, insert.transfer, f"{type(e).__name__}: {e}")
            return False
        return True


def _detached(request: Request) -> DetachedSequence:
    """What a peer needs of a sequence Detach took out (engine.boundary.DetachedSequence)."""
    return DetachedSequence(
        request_id=request.request_id,
        index=request.index,
        prompt_ids=tuple(request.prompt_ids),
        output_ids=tuple(request.output_ids),
        params=request.params,
        seed=request.seed,
        lora_name=request.lora.name if request.lora else None,
        lora_fingerprint=request.lora.fingerprint if request.lora else None,
        cache_salt=request.cache_salt,
        num_kv_tokens=request.num_computed,
    )
