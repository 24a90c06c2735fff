"""Sending a workload to a decode-server's Generation API and recording each request as the client saw it:
open loop (Poisson arrivals at a rate, or all at once) or closed loop (a fixed number in flight); and
conversations of several turns arriving at a rate (run_chats)."""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator

from pdserve.bench.stats import RequestRecord
from pdserve.bench.workload import Chat, RequestSpec, arrival_times


def one_request(
    client,
    spec: RequestSpec,
    t0: float,
    ignore_eos: bool,
    timeout: float | None,
    answer: list[int] | None = None,
) -> RequestRecord:
    """`spec` sent and streamed to its end, as the client saw it; the token ids received go to `answer`."""
    import grpc

    from pdserve.services.client import build_request
    from pdserve.services.wire import FINISH_NAMES

    request = build_request(
        spec.prompt, max_tokens=spec.max_tokens, ignore_eos=ignore_eos, lora_adapter=spec.lora_adapter
    )
    start = time.perf_counter()
    record = RequestRecord(
        index=spec.index,
        start_s=start - t0,
        prompt_tokens=len(spec.prompt) if isinstance(spec.prompt, list) else 0,
        max_tokens=spec.max_tokens,
    )
    try:
        for response in client.stream(request, timeout=timeout):
            now = time.perf_counter() - start
            record.token_times_s += [now] * len(response.token_ids)
            if answer is not None:
                answer += response.token_ids
            if response.finish_reason:
                record.finish_reason = FINISH_NAMES[response.finish_reason]
                record.prompt_tokens = response.usage.prompt_tokens or record.prompt_tokens
        record.e2e_s = time.perf_counter() - start
    except grpc.RpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    except Exception as e:  # noqa: BLE001 - a load generator reports, it does not stop
        record.error = f"{type(e).__name__}: {e}"
    return record


def run_load(
    client,
    workload: Iterator[RequestSpec],
    num_requests: int | None = None,
    rate: float | None = None,
    concurrency: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    ignore_eos: bool = True,
    timeout_s: float | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    max_threads: int = 512,
    burstiness: float = 1.0,
) -> tuple[list[RequestRecord], float]:
    """Sends requests from `workload` until `num_requests` are sent or `duration_s` has passed.

    `rate`: Poisson arrivals at this many requests/s (open loop; inf: all at once; `burstiness`: the
    gaps' gamma shape, workload.arrival_times), capped at `max_threads` in flight; `concurrency`: that
    many requests in flight at all times (closed loop). Returns the records (in send order) and the wall
    time from the first send to the last finish.
    """
    if (rate is None) == (concurrency is None):
        raise ValueError("give exactly one of rate and concurrency")
    if num_requests is None and duration_s is None:
        raise ValueError("give num_requests, duration_s or both")
    specs = workload if num_requests is None else itertools.islice(workload, num_requests)
    lock = threading.Lock()
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    deadline = None if duration_s is None else t0 + duration_s

    def run(spec: RequestSpec) -> None:
        record = one_request(client, spec, t0, ignore_eos, timeout_s)
        with lock:
            records.append(record)
        if on_done:
            on_done(record)

    if concurrency is not None:

        def worker() -> None:
            while deadline is None or time.perf_counter() < deadline:
                with lock:
                    spec = next(specs, None)
                if spec is None:
                    return
                run(spec)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        times = arrival_times(rate, seed, burstiness) if math.isfinite(rate) else itertools.repeat(0.0)
        workers = max_threads if num_requests is None else max(1, min(num_requests, max_threads))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="bench") as pool:
            for spec, at in zip(specs, times, strict=False):
                next_at = t0 + at
                if deadline is not None and next_at >= deadline:
                    break
                delay = next_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                pool.submit(run, spec)
    wall = time.perf_counter() - t0
    records.sort(key=lambda r: r.start_s)
    return records, wall


def run_chats(
    client,
    chats: Iterator[Chat],
    num_chats: int,
    rate: float,
    seed: int = 0,
    ignore_eos: bool = True,
    timeout_s: float | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    burstiness: float = 1.0,
    max_threads: int = 512,
) -> tuple[list[RequestRecord], float]:
    """`num_chats` conversations, arriving as run_load's requests do at `rate` (arrival_times); each sends
    its turns one after another, a turn's prompt the conversation so far (every prompt and answer before
    it) and its own tokens, `think_s` after the answer before it ended. A turn that fails ends its
    conversation. Returns a record per turn sent (its index: conversation x turns + turn) and the wall time
    from the first send to the last finish."""
    lock = threading.Lock()
    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    def converse(chat: Chat) -> None:
        history: list[int] = []
        for turn, spec in enumerate(chat.turns):
            if turn:
                time.sleep(chat.think_s)
            prompt = [*history, *spec.prompt]
            index = chat.index * len(chat.turns) + turn
            sent = RequestSpec(index, prompt, spec.max_tokens, spec.lora_adapter)
            answer: list[int] = []
            record = one_request(client, sent, t0, ignore_eos, timeout_s, answer)
            with lock:
                records.append(record)
            if on_done:
                on_done(record)
            if not record.ok:
                return
            history = prompt + answer

    times = arrival_times(rate, seed, burstiness) if math.isfinite(rate) else itertools.repeat(0.0)
    workers = max(1, min(num_chats, max_threads))  # (conversations in flight)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="chat") as pool:
        for chat, at in zip(itertools.islice(chats, num_chats), times, strict=False):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(converse, chat)
    return records, time.perf_counter() - t0
