"""Benchmark of kvtransfer: stage and end-to-end throughput for 1..256 MiB of KV, with references.

    .venv/bin/python bench/bench_kvtransfer.py [--sizes 1,4,16,64,256] [--repeats 3]

    .venv/bin/python bench/bench_kvtransfer.py --dtype bfloat16

Layout: SmolLM2-135M's cache (30 layers, 3 kv heads, head_dim 64, float32 as the engine keeps it, or
bfloat16; block size 16), TP 1 on both sides, 4 MiB frames (full chunks: all 30 layers x 5 blocks in
float32, 11 in bfloat16). Source blocks scattered, destination blocks in runs of 8 (a mixed list).
Stages (one process): gather (device), encode (device->host, crc32c, framing), decode (parse, verify),
reshard (host -> destination mesh), insert (donated cache). End to end:
- grpc: a second process holds the prefill cache; Send -> gather there -> Pull stream over loopback ->
  verify -> device_put -> insert here. Reference: raw-bytes gRPC streaming of the same number of bytes
  between the same two processes, 4 MiB messages, measured in the same run.
- local: LocalTransport between two meshes of this process (gather, move to the destination mesh,
  insert; chunks of up to 64 MiB). Reference: a numpy copy of the same bytes.
Peak extra memory during receive+insert is the rise of this process's peak RSS (VmHWM) over its RSS
before, read from /proc after returning free heap pages (malloc_trim) and resetting the peak (clear_refs 5).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import grpc  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from kvtransfer import (  # noqa: E402
    FrameAssembler,
    FrameEncoder,
    GrpcTransport,
    KVLayout,
    LayerSpec,
    LocalTransport,
    cache_sharding,
    chunk_sharding,
    deserialize_frame,
    gather_request,
    insert,
    insert_stream,
    serialize_frame,
)
from kvtransfer.gather import _gather_kernel  # noqa: E402
from kvtransfer.insert import _insert_kernel, insert_scratch_bytes  # noqa: E402
from kvtransfer.plan import MAX_FRAME_BYTES, chunk_shapes, plan_frames  # noqa: E402
from kvtransfer.synthetic import make_cache  # noqa: E402
from kvtransfer.transport import grpc_options  # noqa: E402

DTYPE = os.environ.get("KVBENCH_DTYPE", "float32")  # set by --dtype, for this process and the peer
os.environ["KVBENCH_DTYPE"] = DTYPE
LAYOUT = KVLayout("SmolLM2-135M-Instruct", (LayerSpec(),) * 30, 3, 64, DTYPE, 16)
TOKEN_BYTES = LAYOUT.num_cache_layers * LAYOUT.block_bytes // LAYOUT.block_size
NUM_BLOCKS = 1024  # 360 MiB per cache
RAW_CHUNK = MAX_FRAME_BYTES - 64


def request_blocks(mib: int, seed: int = 0) -> tuple[list[int], list[int], int]:
    """(source blocks, destination blocks, tokens) of a request holding `mib` MiB of KV."""
    tokens = (mib << 20) // TOKEN_BYTES
    n = -(-tokens // LAYOUT.block_size)
    rng = np.random.default_rng(seed + mib)
    src = rng.permutation(NUM_BLOCKS)[:n].tolist()
    runs = rng.permutation(NUM_BLOCKS // 8)[: -(-n // 8)]
    dst = [int(r) * 8 + i for r in runs for i in range(8)][:n]
    return src, dst, tokens


def mesh_of(device: int) -> Mesh:
    return Mesh(np.array(jax.devices()[device : device + 1]), ("model",))


# The peer process: prefill side of the gRPC transport plus a raw-bytes streaming reference.


def serve() -> None:
    src_mesh = mesh_of(0)
    cache = jax.device_put(make_cache(LAYOUT, NUM_BLOCKS), cache_sharding(src_mesh, LAYOUT))
    transport = GrpcTransport(LAYOUT)
    raw: list[bytes] = []

    def send(request: bytes, context) -> bytes:
        r = json.loads(request)
        transport.send(r["id"], cache, r["blocks"], r["tokens"])
        return b""

    def prepare_raw(request: bytes, context) -> bytes:
        nbytes = int(request)
        payload = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8).tobytes()
        raw[:] = [payload[i : i + RAW_CHUNK] for i in range(0, nbytes, RAW_CHUNK)]
        return b""

    def stream_raw(request: bytes, context):
        yield from raw

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=grpc_options(MAX_FRAME_BYTES))
    control = {
        "Send": grpc.unary_unary_rpc_method_handler(send),
        "PrepareRaw": grpc.unary_unary_rpc_method_handler(prepare_raw),
        "StreamRaw": grpc.unary_stream_rpc_method_handler(stream_raw),
    }
    server.add_generic_rpc_handlers(
        (transport.handler(), grpc.method_handlers_generic_handler("bench.Control", control))
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(None)


# The main process: decode side, stage measurements, local transport.


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def numpy_copy_time(nbytes: int, repeats: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages first
    return best_time(lambda: np.copyto(dst, src), repeats)


def rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_extra(fn) -> int:
    """Rise of peak RSS over the RSS before fn() (the kernel's peak counter is reset first)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap pages out of RSS, so that reusing them counts
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_bytes("VmRSS")
    fn()
    return rss_bytes("VmHWM") - before


class Bench:
    def __init__(self, repeats: int, port: int):
        self.repeats = repeats
        self.src_mesh, self.dst_mesh = mesh_of(0), mesh_of(1)
        self.src = jax.device_put(make_cache(LAYOUT, NUM_BLOCKS), cache_sharding(self.src_mesh, LAYOUT))
        host = np.zeros(LAYOUT.cache_shape(NUM_BLOCKS), LAYOUT.np_dtype)
        self.dst = jax.device_put(host, cache_sharding(self.dst_mesh, LAYOUT))
        self.sharding = chunk_sharding(self.dst_mesh, LAYOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_options(MAX_FRAME_BYTES))
        self.send = self.channel.unary_unary("/bench.Control/Send")
        self.prepare_raw = self.channel.unary_unary("/bench.Control/PrepareRaw")
        self.stream_raw = self.channel.unary_stream("/bench.Control/StreamRaw")
        self.grpc = GrpcTransport(LAYOUT, mesh=self.dst_mesh, peer=f"127.0.0.1:{port}")
        self.local = LocalTransport(LAYOUT, LAYOUT, self.dst_mesh)
        self.count = 0

    def insert_all(self, chunks, blocks):
        self.dst = insert_stream(self.dst, chunks, blocks)
        jax.block_until_ready(self.dst)

    def grpc_e2e(self, src_blocks, dst_blocks, tokens, do_insert=True):
        self.count += 1
        rid = f"r{self.count}"
        self.send(json.dumps({"id": rid, "blocks": src_blocks, "tokens": tokens}).encode())
        chunks = self.grpc.receive(rid, tokens)
        if do_insert:
            self.insert_all(chunks, dst_blocks)
        else:
            jax.block_until_ready([c.data for c in chunks])

    def local_e2e(self, src_blocks, dst_blocks, tokens):
        self.count += 1
        self.local.send(f"l{self.count}", self.src, src_blocks, tokens)
        self.insert_all(self.local.receive(f"l{self.count}", tokens), dst_blocks)

    def raw(self, nbytes):
        received = sum(len(m) for m in self.stream_raw(b""))
        assert received == nbytes

    def measure(self, mib: int) -> dict:
        src_blocks, dst_blocks, tokens = request_blocks(mib)
        nbytes = tokens * TOKEN_BYTES
        r = self.repeats
        state = {}

        def gather_stage():
            state["chunks"] = gather_request(self.src, LAYOUT, src_blocks, tokens)
            jax.block_until_ready([c.data for c in state["chunks"]])

        def encode_stage():
            encoder = FrameEncoder("b", LAYOUT, tokens)
            state["messages"] = [serialize_frame(f) for f in encoder.frames(state["chunks"], src_blocks)]

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
            row[stage.__name__.removesuffix("_stage")] = nbytes / best_time(stage, r) / 1e9
        frame_bytes = max(len(m) for m in state["messages"])
        row["scratch_mib"] = (
            max(insert_scratch_bytes(self.dst, c, dst_blocks) for c in state["device"][:2]) / 2**20
        )
        state.clear()

        self.grpc_e2e(src_blocks, dst_blocks, tokens)  # warm-up
        self.prepare_raw(str(nbytes).encode())
        self.raw(nbytes)
        # Interleaved, so that the transport and its reference see the same load on the shared cores.
        runs = {
            "grpc_wire": lambda: self.grpc_e2e(src_blocks, dst_blocks, tokens, False),
            "grpc_e2e": lambda: self.grpc_e2e(src_blocks, dst_blocks, tokens),
            "grpc_raw": lambda: self.raw(nbytes),
        }
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(r):
            for key, fn in runs.items():
                best[key] = min(best[key], best_time(fn, 1))
        row.update({key: nbytes / t / 1e9 for key, t in best.items()})

        self.local_e2e(src_blocks, dst_blocks, tokens)
        row["local_e2e"] = nbytes / best_time(lambda: self.local_e2e(src_blocks, dst_blocks, tokens), r) / 1e9
        row["numpy_copy"] = nbytes / numpy_copy_time(nbytes, r) / 1e9

        row["mem_extra_mib"] = peak_extra(lambda: self.grpc_e2e(src_blocks, dst_blocks, tokens)) / 2**20
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
            "gather": _gather_kernel._cache_size(),  # every variant compiled in this process
            "insert": _insert_kernel._cache_size(),
            "seconds": time.perf_counter() - start,
        }


COLUMNS = [
    ("MiB", "mib", "{:d}"),
    ("frames", "frames", "{:d}"),
    ("gather", "gather", "{:.2f}"),
    ("encode", "encode", "{:.2f}"),
    ("decode", "decode", "{:.2f}"),
    ("reshard", "reshard", "{:.2f}"),
    ("insert", "insert", "{:.2f}"),
    ("grpc wire", "grpc_wire", "{:.2f}"),
    ("grpc e2e", "grpc_e2e", "{:.2f}"),
    ("raw gRPC", "grpc_raw", "{:.2f}"),
    ("e2e/raw", "ratio_grpc", "{:.0%}"),
    ("wire/raw", "ratio_wire", "{:.0%}"),
    ("local e2e", "local_e2e", "{:.2f}"),
    ("numpy copy", "numpy_copy", "{:.2f}"),
    ("local/copy", "ratio_local", "{:.0%}"),
    ("peak extra MiB", "mem_extra_mib", "{:.1f}"),
    ("insert scratch MiB", "scratch_mib", "{:.2f}"),
    ("frame MiB", "frame_mib", "{:.2f}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,4,16,64,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="float32 (the engine's cache, default) or bfloat16")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dtype and args.dtype != DTYPE:  # the layout is fixed at import: run again with it
        os.environ["KVBENCH_DTYPE"] = args.dtype
        os.execv(sys.executable, [sys.executable, __file__, *sys.argv[1:]])
    if args.serve:
        return serve()
    peer = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        bench = Bench(args.repeats, int(peer.stdout.readline()))
        rows = []
        for mib in (int(s) for s in args.sizes.split(",")):
            row = bench.measure(mib)
            row["ratio_grpc"] = row["grpc_e2e"] / row["grpc_raw"]
            row["ratio_wire"] = row["grpc_wire"] / row["grpc_raw"]
            row["ratio_local"] = row["local_e2e"] / row["numpy_copy"]
            rows.append(row)
            print(f"measured {mib} MiB", file=sys.stderr, flush=True)
        print(
            f"{DTYPE}: throughput in GB/s (10^9 B/s) of KV bytes; ratios against references measured in the"
            " same run.\n"
        )
        print("| " + " | ".join(name for name, _, _ in COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
        for row in rows:
            print("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in COLUMNS) + " |")
        variants = bench.compiled_variants()
        print(
            f"\nCompiled variants for requests of 1..512 blocks: {variants['chunk_shapes']} chunk shapes, "
            f"{variants['gather']} gather and {variants['insert']} insert kernels "
            f"(compiled and run in {variants['seconds']:.1f} s)."
        )
    finally:
        peer.stdin.close()
        peer.wait(timeout=60)


if __name__ == "__main__":
    main()
