"""Benchmark of kvtransfer: stage and end-to-end throughput for 1..256 MiB of KV, with references.

    .venv/bin/python bench/bench_kvtransfer.py [--sizes 1,4,16,64,256] [--repeats 3]

    .venv/bin/python bench/bench_kvtransfer.py --dtype bfloat16

    .venv/bin/python bench/bench_kvtransfer.py --smoke [--json OUT]

Layout: SmolLM2-135M's cache (30 layers, 3 kv heads, head_dim 64, float32 as the engine keeps it, or
bfloat16; block size 16), TP 1 on both sides, 4 MiB frames (full chunks: all 30 layers x 5 blocks in
float32, 11 in bfloat16). Source blocks scattered, destination blocks in runs of 8 (a mixed list).
Stages (one process, synthetic cache): gather (device), encode (device->host, crc32c, framing: the
prefill server's kvtransfer.encode_request), decode (parse, verify), reshard (host -> destination mesh),
insert (donated cache).

The daemons' paths, end to end (class DaemonPaths), with the default model's real engines:
- grpc: a second process runs a prefill server (services.prefill.server.PrefillService); this process runs
  a decode server's core against it over loopback (RemotePrefiller, DecodeConnector inserts). Reference:
  raw-bytes gRPC streaming of the same number of bytes between the same two processes, 4 MiB messages.
- local: `pdserve serve`'s core in this process (LocalPrefiller engine on device 0 -> decode engine on
  device 1). Reference: a numpy copy of the same bytes.

--smoke: the stages only (the paths need the peer process and the default model), 1 MiB once, on a cache
of 64 blocks; no compiled-variants count.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import grpc  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from pdserve.bench.common import best_of, report  # noqa: E402
from pdserve.kvtransfer import (  # noqa: E402
    FrameAssembler,
    KVLayout,
    LayerSpec,
    cache_sharding,
    chunk_sharding,
    deserialize_frame,
    encode_request,
    gather_request,
    insert,
    insert_stream,
)
from pdserve.kvtransfer.gather import gather_kernel  # noqa: E402
from pdserve.kvtransfer.insert import insert_kernel, insert_scratch_bytes  # noqa: E402
from pdserve.kvtransfer.plan import MAX_FRAME_BYTES, chunk_shapes, plan_frames  # noqa: E402
from pdserve.testing.kv_cache import make_cache  # noqa: E402

DTYPE = os.environ.get("KVBENCH_DTYPE", "float32")  # set by --dtype, for this process and the peer
os.environ["KVBENCH_DTYPE"] = DTYPE
LAYOUT = KVLayout("SmolLM2-135M-Instruct", (LayerSpec(),) * 30, 3, 64, DTYPE, 16)
TOKEN_BYTES = LAYOUT.num_cache_layers * LAYOUT.block_bytes // LAYOUT.block_size
NUM_BLOCKS = 1024  # 360 MiB per cache
RAW_CHUNK = MAX_FRAME_BYTES - 64


def _engine_config():
    from pdserve.engine.config import EngineConfig

    # 4,096 tokens (180 MiB of float32 KV) fit a request; the prefix cache keeps repeats cheap to compute.
    return EngineConfig(max_model_len=4096, num_blocks=512, max_num_seqs=4, max_num_batched_tokens=512)


def request_blocks(mib: int, seed: int = 0, num_blocks: int = NUM_BLOCKS) -> tuple[list[int], list[int], int]:
    """(source blocks, destination blocks, tokens) of a request holding `mib` MiB of KV."""
    tokens = (mib << 20) // TOKEN_BYTES
    n = -(-tokens // LAYOUT.block_size)
    rng = np.random.default_rng(seed + mib)
    src = rng.permutation(num_blocks)[:n].tolist()
    runs = rng.permutation(num_blocks // 8)[: -(-n // 8)]
    dst = [int(r) * 8 + i for r in runs for i in range(8)][:n]
    return src, dst, tokens


def mesh_of(device: int) -> Mesh:
    return Mesh(np.array(jax.devices()[device : device + 1]), ("model",))


# The peer process: a prefill server exactly as `prefill-server` runs it (PrefillService over the default
# model on its own engine thread), plus a raw-bytes streaming reference on the same gRPC server.


def serve() -> None:
    import asyncio

    from pdserve.daemons import keep_freed_memory
    from pdserve.engine.compile_cache import configure_jax
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.services.grpc_server import RunningServer
    from pdserve.services.prefill.server import SERVICE_NAME, PrefillService, add_to_server

    keep_freed_memory()  # as the daemons do
    configure_jax()
    service = PrefillService.for_engine(LLMEngine.from_model(None, _engine_config(), warmup=False))
    raw: list[bytes] = []

    async def prepare_raw(request: bytes, context) -> bytes:
        nbytes = int(request)
        payload = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8).tobytes()
        raw[:] = [payload[i : i + RAW_CHUNK] for i in range(0, nbytes, RAW_CHUNK)]
        return b""

    async def stream_raw(request: bytes, context):
        for message in raw:
            yield message

    def register(server) -> None:
        add_to_server(server, service)
        control = {
            "PrepareRaw": grpc.unary_unary_rpc_method_handler(prepare_raw),
            "StreamRaw": grpc.unary_stream_rpc_method_handler(stream_raw),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Raw", control),))

    async def main() -> None:
        service.loop.start()
        running = await RunningServer.start([SERVICE_NAME], register, "127.0.0.1", 0)
        print(running.port, flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await running.stop(1)
        service.loop.stop()

    asyncio.run(main())


def numpy_copy_time(nbytes: int, repeats: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages first
    return best_of(lambda: np.copyto(dst, src), repeats)


class Bench:
    """kvtransfer's stages on a synthetic cache of the model's layout, between two meshes of this process."""

    def __init__(self, repeats: int, num_blocks: int = NUM_BLOCKS):
        self.repeats, self.num_blocks = repeats, num_blocks
        self.src_mesh, self.dst_mesh = mesh_of(0), mesh_of(1)
        self.src = jax.device_put(make_cache(LAYOUT, num_blocks), cache_sharding(self.src_mesh, LAYOUT))
        host = np.zeros(LAYOUT.cache_shape(num_blocks), LAYOUT.np_dtype)
        self.dst = jax.device_put(host, cache_sharding(self.dst_mesh, LAYOUT))
        self.sharding = chunk_sharding(self.dst_mesh, LAYOUT)

    def insert_all(self, chunks, blocks):
        self.dst = insert_stream(self.dst, chunks, blocks)
        jax.block_until_ready(self.dst)

    def measure(self, mib: int) -> dict:
        src_blocks, dst_blocks, tokens = request_blocks(mib, num_blocks=self.num_blocks)
        nbytes = tokens * TOKEN_BYTES
        r = self.repeats
        state = {}

        def gather_stage():
            state["chunks"] = gather_request(self.src, LAYOUT, src_blocks, tokens)
            jax.block_until_ready([c.data for c in state["chunks"]])

        def encode_stage():  # the prefill server's sender, without its prefetch thread
            state["messages"] = list(encode_request("b", LAYOUT, tokens, list(state["chunks"])))

        def decode_stage():
            assembler = FrameAssembler("b", tokens, LAYOUT, LAYOUT)
            state["host"] = [assembler.add(deserialize_frame(m)) for m in state["messages"]]
            assembler.finish()

        def reshard_stage():
            state["device"] = [
                c.__class__(c.layer_start, c.token_start, c.num_tokens, jax.device_put(c.data, self.sharding))
                for c in state["host"]
            ]
            jax.block_until_ready([c.data for c in state["device"]])

        def insert_stage():
            self.insert_all(state["device"], dst_blocks)

        stages = [gather_stage, encode_stage, decode_stage, reshard_stage, insert_stage]
        for stage in stages:  # warm-up: compiles every chunk shape of this size
            stage()
        row = {"mib": mib, "tokens": tokens, "blocks": len(src_blocks), "frames": len(state["messages"])}
        for stage in stages:
            row[stage.__name__.removesuffix("_stage")] = nbytes / best_of(stage, r) / 1e9
        frame_bytes = max(len(m) for m in state["messages"])
        row["scratch_mib"] = (
            max(insert_scratch_bytes(self.dst, c, dst_blocks) for c in state["device"][:2]) / 2**20
        )
        state.clear()

        row["frame_mib"] = frame_bytes / 2**20
        return row

    def compiled_variants(self) -> dict:
        """Compiled gather/insert variants for requests of 1..512 blocks: one request per chunk shape
        (contiguous and scattered blocks, so both modes of each kernel compile)."""
        shapes = chunk_shapes(LAYOUT, 512)
        lengths = {}
        for n in range(1, 513):
            for p in plan_frames(LAYOUT, n * LAYOUT.block_size):
                lengths.setdefault((p.num_layers, p.bucket), n)
        start = time.perf_counter()
        for n in sorted(set(lengths.values())):
            for src_blocks in (list(range(n)), list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - n, -1))):
                for chunk in gather_request(self.src, LAYOUT, src_blocks, n * LAYOUT.block_size):
                    chunk = chunk.__class__(
                        chunk.layer_start,
                        chunk.token_start,
                        chunk.num_tokens,
                        jax.device_put(chunk.data, self.sharding),
                    )
                    self.dst = insert(self.dst, chunk, src_blocks)
        jax.block_until_ready(self.dst)
        return {
            "chunk_shapes": len(shapes),
            "gather": gather_kernel._cache_size(),  # every variant compiled in this process
            "insert": insert_kernel._cache_size(),
            "seconds": time.perf_counter() - start,
        }


class DaemonPaths:
    """The daemons' two KV paths with the default model, in this process's decode engines:

    - grpc: a decode server's core (GenerationCore: admission, RemotePrefiller's verified receive, the
      DecodeConnector's inserts) against the peer's prefill server, over loopback; reference: the raw bytes
      streamed between the same two processes, 4 MiB messages.
    - local: `pdserve serve`'s core, a LocalPrefiller engine on device 0 and the decode engine on device 1
      (gather with head conversion, device_put aliasing host memory, insert); reference: a numpy copy.

    Seconds are the decode server's own kv_transfer_seconds (the first token's arrival to the request's
    start), with one sync added: the cache is ready before the request starts, so the inserts count.
    """

    def __init__(self, port: int):
        from pdserve.daemons import keep_freed_memory
        from pdserve.engine.compile_cache import configure_jax
        from pdserve.engine.llm_engine import LLMEngine
        from pdserve.engine.loading.sources import load_model
        from pdserve.services.decode.core import GenerationCore
        from pdserve.services.decode.local_prefiller import LocalPrefiller
        from pdserve.services.engine_loop import EngineLoop
        from pdserve.services.grpc_server import channel_options

        keep_freed_memory()  # as the daemons do
        configure_jax()
        model = load_model(None)
        devices = jax.devices()
        remote_engine = LLMEngine(model, _engine_config(), [devices[1]])
        self.remote = GenerationCore.for_engine(remote_engine, prefill_targets=[f"127.0.0.1:{port}"])
        prefill_engine = LLMEngine(model, _engine_config(), [devices[0]])
        local_engine = LLMEngine(model, _engine_config(), [devices[1]])
        self.prefill_loop = EngineLoop(prefill_engine, name="prefill-engine")
        local = LocalPrefiller(self.prefill_loop, prefill_engine.kv_layout)
        self.local = GenerationCore.for_engine(local_engine, local_prefiller=local)
        for engine in (remote_engine, local_engine):
            _sync_before_start(engine)
        self.layout = remote_engine.kv_layout
        self.token_bytes = self.layout.num_cache_layers * self.layout.block_bytes // self.layout.block_size
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
        self.prepare_raw = self.channel.unary_unary("/bench.Raw/PrepareRaw")
        self.stream_raw = self.channel.unary_stream("/bench.Raw/StreamRaw")

    async def start(self) -> None:
        self.prefill_loop.start()
        await self.remote.start()
        await self.local.start()

    async def close(self) -> None:
        await self.remote.close()
        await self.local.close()
        self.prefill_loop.stop()
        await self.channel.close()

    async def transfer(self, core, prompt: list[int]) -> tuple[float, int]:
        """One request through `core`: (KV transfer seconds, KV bytes) from its counters."""
        from pdserve.engine.sampling_params import SamplingParams

        c = core.counters
        seconds, nbytes = c.kv_transfer_seconds_total, c.kv_transfer_bytes_total
        request = core.make_request(prompt, SamplingParams(temperature=0, max_tokens=1))
        async for _ in core.stream(request):
            pass
        return c.kv_transfer_seconds_total - seconds, c.kv_transfer_bytes_total - nbytes

    async def raw(self, nbytes: int) -> float:
        start = time.perf_counter()
        received = 0
        async for message in self.stream_raw(b""):
            received += len(message)
        assert received == nbytes
        return time.perf_counter() - start

    async def measure(self, mib: int, repeats: int) -> dict:
        tokens = max(1, (mib << 20) // self.token_bytes)
        prompt = np.random.default_rng(mib).integers(100, 40000, tokens).tolist()
        best = {"grpc_e2e": float("inf"), "grpc_raw": float("inf"), "local_e2e": float("inf")}
        _, nbytes = await self.transfer(self.remote, prompt)  # warm-up: compiles, fills the prefix cache
        await self.transfer(self.local, prompt)
        await self.prepare_raw(str(nbytes).encode())
        await self.raw(nbytes)
        for _ in range(repeats):  # interleaved: each path and its reference see the same load
            best["grpc_e2e"] = min(best["grpc_e2e"], (await self.transfer(self.remote, prompt))[0])
            best["grpc_raw"] = min(best["grpc_raw"], await self.raw(nbytes))
            best["local_e2e"] = min(best["local_e2e"], (await self.transfer(self.local, prompt))[0])
        row = {"mib": mib, "tokens": tokens, "kv_mib": nbytes / 2**20}
        row.update({key: nbytes / seconds / 1e9 for key, seconds in best.items()})
        row["numpy_copy"] = nbytes / numpy_copy_time(nbytes, repeats) / 1e9
        row["ratio_grpc"] = row["grpc_e2e"] / row["grpc_raw"]
        row["ratio_local"] = row["local_e2e"] / row["numpy_copy"]
        return row


def _sync_before_start(engine) -> None:
    """The engine's cache is ready (every insert done) before a transferred request starts: the bench's
    one addition to the daemon path, so that kv_transfer_seconds covers the inserts."""
    start = engine._remote_kv_done

    def remote_kv_done(*args):
        jax.block_until_ready(engine.runner.cache)
        return start(*args)

    engine._remote_kv_done = remote_kv_done


STAGE_COLUMNS = [
    ("MiB", "mib", "{:d}"),
    ("frames", "frames", "{:d}"),
    ("gather", "gather", "{:.2f}"),
    ("encode", "encode", "{:.2f}"),
    ("decode", "decode", "{:.2f}"),
    ("reshard", "reshard", "{:.2f}"),
    ("insert", "insert", "{:.2f}"),
    ("insert scratch MiB", "scratch_mib", "{:.2f}"),
    ("frame MiB", "frame_mib", "{:.2f}"),
]
PATH_COLUMNS = [
    ("MiB", "kv_mib", "{:.1f}"),
    ("tokens", "tokens", "{:d}"),
    ("grpc e2e", "grpc_e2e", "{:.2f}"),
    ("raw gRPC", "grpc_raw", "{:.2f}"),
    ("e2e/raw", "ratio_grpc", "{:.0%}"),
    ("local e2e", "local_e2e", "{:.2f}"),
    ("numpy copy", "numpy_copy", "{:.2f}"),
    ("local/copy", "ratio_local", "{:.0%}"),
]


def table(rows: list[dict], columns) -> None:
    print("| " + " | ".join(name for name, _, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in columns) + " |")


async def measure_paths(port: int, sizes: list[int], repeats: int) -> list[dict]:
    paths = DaemonPaths(port)
    await paths.start()
    try:
        rows = []
        for mib in sizes:
            rows.append(await paths.measure(mib, repeats))
            print(f"measured the daemons' paths at {mib} MiB", file=sys.stderr, flush=True)
        return rows
    finally:
        await paths.close()


def main(argv: list[str] | None = None) -> None:
    import asyncio

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,4,16,64,256", help="MiB of KV (the daemons' paths: <= 160)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="float32 (the engine's cache, default) or bfloat16")
    parser.add_argument("--skip-stages", action="store_true")
    parser.add_argument("--skip-paths", action="store_true")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="also write the measured rows here")
    parser.add_argument("--smoke", action="store_true", help="the stages at 1 MiB once, a small cache")
    args = parser.parse_args(argv)
    if args.dtype and args.dtype != DTYPE:  # the layout is fixed at import: run again with it
        os.environ["KVBENCH_DTYPE"] = args.dtype
        os.execv(sys.executable, [sys.executable, __file__, *sys.argv[1:]])
    if args.serve:
        return serve()
    if args.smoke:
        args.sizes, args.repeats, args.skip_paths = "1", 1, True
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {"dtype": DTYPE}
    if not args.skip_stages:
        bench = Bench(args.repeats, 64) if args.smoke else Bench(args.repeats)
        rows = []
        for mib in sizes:
            rows.append(bench.measure(mib))
            print(f"measured the stages at {mib} MiB", file=sys.stderr, flush=True)
        print(f"{DTYPE}, synthetic cache: stage throughput in GB/s (10^9 B/s) of KV bytes.\n")
        table(rows, STAGE_COLUMNS)
        result["stages"] = rows
        if not args.smoke:
            variants = result["compiled_variants"] = bench.compiled_variants()
            print(
                "\nCompiled variants for requests of 1..512 blocks: "
                f"{variants['chunk_shapes']} chunk shapes, {variants['gather']} gather and "
                f"{variants['insert']} insert kernels "
                f"(compiled and run in {variants['seconds']:.1f} s).\n"
            )
        del bench
    if args.skip_paths:
        report(result, args.json, echo=False)
        return None
    peer = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(peer.stdout.readline())
        rows = asyncio.run(measure_paths(port, [m for m in sizes if m <= 160], args.repeats))
        print(
            "The daemons' paths, default model (float32 cache): KV end to end in GB/s; ratios against"
            " references measured in the same run.\n"
        )
        table(rows, PATH_COLUMNS)
        result["paths"] = rows
    finally:
        peer.stdin.close()
        peer.wait(timeout=120)
    report(result, args.json, echo=False)
    return None


if __name__ == "__main__":
    main()
