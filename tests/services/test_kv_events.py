"""KV cache events without a model: the wire format (vLLM's, as llm-d's router reads it), a real publisher's
ZMQ sockets on loopback followed by the decode side's index through restarts, gaps and a cut stream."""

import asyncio

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.core.kv_events import DEVICE, HOST, AllBlocksCleared, BlockRemoved, BlockStored
from pdserve.services.decode.prefix_index import ReplicaCache, follow, replay
from pdserve.services.kv_events_zmq import (
    CurveKeys,
    KVEventPublisher,
    ReaderCredentials,
    decode_batch,
    encode_batch,
    parse_reader_key,
    topic,
)

pytestmark = pytest.mark.fast

BIG = 2**63 + 5


def test_batches_are_vllms_tagged_arrays_with_8_byte_hashes():
    events = [BlockStored([BIG, 7], None, [1, 2, 3, 4], 2, "ad"), BlockRemoved([7]), AllBlocksCleared()]
    raw = msgpack.unpackb(encode_batch(events, timestamp=1.5), raw=False)
    assert raw == [
        1.5,
        [
            [
                "BlockStored",
                [BIG.to_bytes(8, "big"), (7).to_bytes(8, "big")],
                None,
                [1, 2, 3, 4],
                2,
                None,
                "GPU",
                "ad",
            ],
            ["BlockRemoved", [(7).to_bytes(8, "big")], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert decode_batch(encode_batch(events))[1] == events
    # vLLM's own batches: integer hashes, the older field lists (no medium, no lora_name), extra trailing ones
    vllm = msgpack.packb(
        [
            2.0,
            [
                ["BlockStored", [BIG, 3], 9, [5, 6], 1, None],
                ["BlockRemoved", [3]],
                ["BlockStored", [4], None, [7], 1, None, "GPU", None, None, 0, None, None],
            ],
        ]
    )
    assert decode_batch(vllm)[1] == [
        BlockStored([BIG, 3], 9, [5, 6], 1),
        BlockRemoved([3]),
        BlockStored([4], None, [7], 1),
    ]
    for bad in (b"\xc1", msgpack.packb([1.0, [["Nope"]]]), msgpack.packb([1.0, [["BlockRemoved", ["x"]]]])):
        with pytest.raises(ValueError):
            decode_batch(bad)
    assert topic("10.0.0.7:8000", "smollm2") == "kv@10.0.0.7:8000@smollm2"
    with pytest.raises(ValueError):
        topic("a@b", "m")


def test_the_default_ports_fall_back_to_free_ones_on_a_shared_host_and_a_port_given_must_bind():
    import zmq

    first = KVEventPublisher(topic("a:1", "m"))  # 5557 / 5558, unless something else of this host has them
    second = KVEventPublisher(topic("a:2", "m"))  # a prefill-server and a decode-server side by side
    try:
        assert len({first.port, first.replay_port, second.port, second.replay_port}) == 4
        with pytest.raises(zmq.ZMQError):
            KVEventPublisher(topic("a:3", "m"), port=first.port)
    finally:
        first.close()
        second.close()


def _batch(seq, events):
    payload = encode_batch(events, timestamp=float(seq))
    return seq, payload, events


def test_the_host_tier_is_medium_cpu_and_a_host_block_counts_as_held():
    """A block the device evicts into the host tier: removed on "GPU", stored on "CPU" (llm-d's medium
    field), and a replica index still counts it as held until the host tier evicts it too."""
    events = [BlockRemoved([5], DEVICE), BlockStored([5], 4, [1, 2], 2, None, HOST), BlockRemoved([5], HOST)]
    raw = msgpack.unpackb(encode_batch(events[:2]), raw=False)[1]
    assert raw[0][2] == "GPU" and raw[1][6] == "CPU"
    assert decode_batch(encode_batch(events))[1] == events
    with pytest.raises(ValueError, match="medium"):
        decode_batch(msgpack.packb([1.0, [["BlockRemoved", [5], "DISK"]]]))
    cache = ReplicaCache("r")
    cache.rebuild([_batch(0, [AllBlocksCleared(), BlockStored([4, 5], None, [0] * 4, 2)])])
    cache.apply(*_batch(1, events[:2]))
    assert cache.hashes == {4} and cache.host_hashes == {5} and cache.matched_blocks([4, 5]) == 2
    cache.apply(*_batch(2, events[2:]))
    assert cache.matched_blocks([4, 5]) == 1


def test_index_applies_in_order_and_rebuilds_after_a_restart_or_lost_batches():
    cache = ReplicaCache("r")
    b0, b1 = _batch(0, [AllBlocksCleared()]), _batch(1, [BlockStored([1, 2], None, [0, 0], 1)])
    cache.rebuild([b0, b1])
    assert cache.hashes == {1, 2} and cache.last_seq == 1 and cache.matched_blocks([1, 2, 3]) == 2
    b2 = _batch(2, [BlockRemoved([2]), BlockStored([3], 1, [0], 1)])
    assert cache.is_next(2, b2[1]) is True
    cache.apply(*b2)
    assert cache.is_next(2, b2[1]) is None  # a duplicate (seen again after a replay)
    assert cache.is_next(5, b"x") is False  # a gap
    cache.rebuild([b2, _batch(3, [BlockStored([4], None, [0], 1)])])  # the replay continues where we are
    assert cache.hashes == {1, 3, 4} and cache.num_resyncs == 0
    cache.rebuild([_batch(0, [AllBlocksCleared()])])  # restarted: its history starts over, empty
    assert cache.hashes == set() and cache.last_seq == 0 and cache.num_resyncs == 1
    assert cache.is_next(2, b2[1]) is False  # the old instance's batch 2 is not this one's
    cache.apply(*_batch(1, [BlockStored([8], None, [0], 1)]))
    cache.rebuild([_batch(7, [BlockStored([9], None, [0], 1)])])  # batches 2-6 lost beyond the buffer
    assert cache.hashes == {9} and cache.num_resyncs == 2
    # a prompt just routed here counts as held until its events come, or for a while
    cache.expect([9, 10, 11])
    cache.expect([20], ttl_s=0.0)
    assert cache.matched_blocks([9, 10, 11, 12]) == 3 and cache.matched_blocks([20]) == 0
    cache.apply(*_batch(8, [BlockStored([10], 9, [0], 1), BlockRemoved([11])]))
    assert cache.matched_blocks([9, 10, 11]) == 2 and cache.hashes == {9, 10}
    cache.forget([10])
    assert cache.matched_blocks([9, 10]) == 1


async def _until(predicate, timeout=10.0):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


def test_a_follower_tracks_a_publisher_through_its_restart_and_a_cut_stream():
    async def main():
        name = topic("127.0.0.1:1", "m")
        pub = KVEventPublisher(name, port=0, replay_port=0, plain=True)
        port, replay_port = pub.port, pub.replay_port
        pub.publish([AllBlocksCleared()])
        pub.publish([BlockStored([1, 2], None, [0, 0], 1)])
        cache = ReplicaCache("r")
        task = asyncio.create_task(
            follow(cache, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", name, resync_s=0.2)
        )
        try:
            await _until(lambda: cache.hashes == {1, 2})  # caught up from the replay socket
            pub.publish([BlockRemoved([1]), BlockStored([3], 2, [0], 1)])
            await _until(lambda: cache.hashes == {2, 3})  # live
            assert [seq for seq, *_ in await replay(f"tcp://127.0.0.1:{replay_port}", 1)] == [1, 2]
            pub.close()  # the stream is cut: the index stays as it was, the follower keeps trying
            await asyncio.sleep(0.5)
            assert cache.hashes == {2, 3} and not task.done()
            pub = KVEventPublisher(name, port=port, replay_port=replay_port, plain=True)  # restarted, empty
            pub.publish([AllBlocksCleared()])
            await _until(lambda: cache.hashes == set() and cache.num_resyncs == 1)
            pub.publish([BlockStored([5], None, [0], 1)])
            await _until(lambda: cache.hashes == {5})
        finally:
            task.cancel()
            pub.close()

    asyncio.run(main())


def test_an_authenticated_stream_is_read_by_registered_readers_only():
    """By default the publisher speaks CURVE: a plain reader, and a CURVE reader whose key was not
    registered, get nothing from either socket while a registered reader follows every batch; a reader
    that cannot get through is told so after each failed replay (`on_lost`)."""
    import zmq

    async def main():
        name = topic("127.0.0.1:1", "m")
        pub = KVEventPublisher(name, port=0, replay_port=0)
        stream, replays = f"tcp://127.0.0.1:{pub.port}", f"tcp://127.0.0.1:{pub.replay_port}"
        registered, stranger = CurveKeys.generate(), CurveKeys.generate()
        pub.allow(parse_reader_key(registered.public.decode()))
        context = zmq.Context()
        intruders = []
        for keys in (None, stranger):
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            if keys is not None:
                ReaderCredentials(keys, pub.public_key).secure(sub)
            sub.connect(stream)
            intruders.append(sub)
        cache, lost = ReplicaCache("registered"), asyncio.Event()
        strangers_cache = ReplicaCache("stranger")
        tasks = [
            asyncio.create_task(
                follow(cache, stream, replays, name, 0.2, ReaderCredentials(registered, pub.public_key))
            ),
            asyncio.create_task(
                follow(
                    strangers_cache,
                    stream,
                    replays,
                    name,
                    0.2,
                    ReaderCredentials(stranger, pub.public_key),
                    lost.set,
                )
            ),
        ]
        try:
            pub.publish([AllBlocksCleared()])
            for i in range(20):
                pub.publish([BlockStored([i], None, [i], 1)])
                await asyncio.sleep(0.05)
            await _until(lambda: cache.hashes == set(range(20)))  # the registered reader has them all
            async with asyncio.timeout(10):
                await lost.wait()
            for keys in (None, stranger):  # nor does the replay socket answer the others
                with pytest.raises(TimeoutError):
                    await replay(
                        replays, 0, 0.5, None if keys is None else ReaderCredentials(keys, pub.public_key)
                    )
            assert [s.poll(0) for s in intruders] == [0, 0] and strangers_cache.num_batches == 0
            assert pub.num_refused > 0
            assert len(await replay(replays, 0, 5, ReaderCredentials(registered, pub.public_key))) == 21
        finally:
            for task in tasks:
                task.cancel()
            pub.close()
            context.destroy(linger=0)

    asyncio.run(main())
    for key in ("", "x" * 39 + " ", "#" * 40, "é" * 40, CurveKeys.generate().public.decode()[:-1]):
        with pytest.raises(ValueError):
            parse_reader_key(key)


def test_routing_prefers_the_replica_holding_the_prefix_unless_its_queue_costs_more():
    from pdserve.kvtransfer import KVLayout, LayerSpec
    from pdserve.services.decode.config import Routing
    from pdserve.services.decode.remote_prefiller import RemotePrefiller
    from pdserve.services.decode.routing import PrefillPool

    async def main():
        layout = KVLayout("tiny", (LayerSpec(),) * 2, 2, 8, "float32", 4)
        bs = layout.block_size
        pool = PrefillPool([], layout, routing=Routing(load_weight=1.0))
        a, b, c = (RemotePrefiller(f"127.0.0.1:{p}", layout) for p in (1, 2, 3))
        for r in (a, b, c):
            pool.replicas[r.name] = r
            r.cache = ReplicaCache(r.name)
        prompt = [11, 12, 13, 14]  # block hashes of a 4-block prompt
        tokens = 4 * bs + 1
        a.outstanding, b.outstanding = 2, 1
        assert (pool.pick(block_hashes=prompt, num_tokens=tokens).replica, "load") == (c, "load")
        c.outstanding = 3
        route = pool.pick(block_hashes=prompt, num_tokens=tokens)
        assert (route.replica, route.expected_hit_tokens, route.reason) == (b, 0, "load")  # nobody holds it
        a.cache.hashes |= {11, 12, 13}
        b.cache.hashes |= {11, 13, 14}  # not a prefix beyond the first block
        route = pool.pick(block_hashes=prompt, num_tokens=tokens)
        assert (route.replica, route.expected_hit_tokens, route.reason) == (a, 3 * bs, "prefix")
        a.pending_tokens = 3 * bs  # its queue costs more than its longer prefix saves: b's one block wins

        assert pool.pick(block_hashes=prompt, num_tokens=tokens).replica is b
        assert pool.pick(exclude={b.name}, block_hashes=prompt, num_tokens=tokens).replica is a
        pool.routing = Routing("least-outstanding")
        assert pool.pick(block_hashes=prompt, num_tokens=tokens).replica is b
        pool.routing = Routing()
        # an endpoint picker's hint: the replica of that address, else the only one on that host
        hinted = pool.pick(block_hashes=prompt, num_tokens=tokens, prefer="127.0.0.1:3")
        assert (hinted.replica, hinted.reason) == (c, "hint")
        assert pool.pick(exclude={c.name}, prefer="127.0.0.1:3").reason != "hint"  # tried already
        assert pool.pick(prefer="127.0.0.1:8000").reason != "hint"  # three replicas on that host
        assert pool.pick(prefer="10.0.0.9:50051").reason != "hint"  # not ours
        del pool.replicas[b.name], pool.replicas[c.name]
        assert pool.pick(prefer="127.0.0.1:8000").replica is a  # the pool's target port, not Prefill's
        pool.replicas[b.name] = b
        b.mark_failed()  # down: avoided, and what it cached is forgotten
        assert b.cache.hashes == set() and pool.pick(block_hashes=prompt, num_tokens=tokens).replica is a
        assert pool.pick(prefer=b.name).replica is a  # a hint does not revive a replica that is down
        with pytest.raises(ValueError):
            Routing("random")
        for r in (a, b, c):
            await r.close()

    asyncio.run(main())


# ---- what the router makes of them ----------------------------------------------------------------------
_BLOCK = 4
_PROMPTS = st.lists(
    st.integers(0, 2), min_size=1, max_size=5
).map(  # shared heads, then a tail
    lambda parts: [t for p in parts for t in [p * 7 + 1] * _BLOCK][:-1] + [parts[-1] + 50]
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.tuples(_PROMPTS, st.sampled_from([None, "a"]), st.integers(0, 6), st.booleans()), max_size=25
    )
)
def test_the_routers_index_of_the_published_events_equals_the_prefix_cache(steps):
    """Requests (some with an adapter) computed, extended by generated tokens and freed in any order on a
    small cache (evictions): after each, a subscriber written from the router's schema, fed the batches the
    publisher sends, finds for every prompt seen the leading blocks the prefix cache would hit."""
    from pdserve.engine.core.kv_cache_manager import KVCacheManager
    from tests.llmd_index import RouterIndex

    kv = KVCacheManager(10, _BLOCK)
    kv.record_events()
    index, live, seen = RouterIndex(_BLOCK), [], []
    for n, (prompt, lora, generated, finish) in enumerate(steps):
        extra = None if lora is None else f"fingerprint-{lora}"
        rid, tokens = f"r{n}", prompt + list(range(100, 100 + generated))
        if kv.allocate(rid, len(tokens), kv.lookup(prompt, extra), prompt):
            kv.cache_blocks(rid, tokens, len(tokens), extra, lora)
            live.append(rid)
            seen.append((prompt, lora, extra))
        if finish or len(live) > 2:
            kv.free(live.pop(0))
        frames = [b"kv@10.0.0.1:8000@smollm2", n.to_bytes(8, "big"), encode_batch(kv.take_events())]
        index.add_frames(frames, pod="10.0.0.1:8000")
        for prompt, lora, extra in seen:
            cached = len(kv.lookup(prompt + [0], extra))  # lookup never counts the last token
            assert index.matched_blocks("10.0.0.1:8000", prompt, lora or "smollm2") == cached
    assert index.num_dropped == 0 and index.num_restarts == 0


def test_the_router_sees_a_restarted_publisher():
    from tests.llmd_index import RouterIndex

    index, pod = RouterIndex(2), "p:1"
    stored = BlockStored([1], None, [5, 6], 2)
    for seq, events in enumerate([[AllBlocksCleared()], [stored]]):
        index.add_frames([b"kv@p:1@m", seq.to_bytes(8, "big"), encode_batch(events)])
    assert index.matched_blocks(pod, [5, 6], "m") == 1
    index.add_frames([b"kv@p:1@m", (0).to_bytes(8, "big"), encode_batch([AllBlocksCleared()])])
    assert index.num_restarts == 1 and index.matched_blocks(pod, [5, 6], "m") == 0


def test_the_engine_to_publisher_queue_drops_its_oldest_when_full():
    from pdserve.services.kv_events_zmq import DropOldestQueue

    q = DropOldestQueue(3)
    for i in range(5):
        q.put(i)  # never blocks
    assert [q.get_nowait() for _ in range(3)] == [2, 3, 4] and q.num_dropped == 2


def test_a_replay_flood_and_slow_readers_do_not_hold_up_live_batches():
    """Readers that ask for the whole replay buffer again and again and never read their answers: at most
    MAX_REPLAYS are served at once, in slices between live batches, and each is dropped once its
    messages pile up; a healthy subscriber gets every live batch, in order, meanwhile; a replay asked
    for after the flood is answered in full."""
    import zmq

    from pdserve.services.kv_events_zmq import MAX_REPLAYS

    name = topic("127.0.0.1:1", "m")
    pub = KVEventPublisher(name, port=0, replay_port=0, buffer_batches=5000, plain=True)  # (anyone reads)
    context = zmq.Context()
    try:
        for i in range(5000):  # a full replay buffer: a large payload each, so readers fill up fast
            pub.publish([BlockStored([i], None, list(range(64)), 64)])
            while pub.num_batches < i - 500:  # (within the engine-to-publisher queue's bound)
                asyncio.run(asyncio.sleep(0.001))
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, name.encode())
        sub.connect(f"tcp://127.0.0.1:{pub.port}")
        flood = []
        for _ in range(4 * MAX_REPLAYS):
            reader = context.socket(zmq.DEALER)
            reader.setsockopt(zmq.RCVHWM, 10)  # and never reads
            reader.connect(f"tcp://127.0.0.1:{pub.replay_port}")
            for _ in range(3):
                reader.send_multipart((b"", (0).to_bytes(8, "big")))
            flood.append(reader)
        asyncio.run(asyncio.sleep(0.5))  # (the subscription reaches the publisher)
        for i in range(200):
            pub.publish([BlockStored([10_000 + i], None, [0], 1)])
        live = []
        while len(live) < 200:
            assert sub.poll(30_000), f"{len(live)} live batches of 200"
            frames = sub.recv_multipart()
            (event,) = decode_batch(frames[2])[1]
            if event.block_hashes[0] >= 10_000:
                live.append(event.block_hashes[0] - 10_000)
        assert live == list(range(200)) and pub.num_dropped == 0
        assert len(pub._replays) <= MAX_REPLAYS
        for reader in flood:
            reader.close(linger=0)
        batches = asyncio.run(replay(f"tcp://127.0.0.1:{pub.replay_port}", 5100, timeout_s=30))
        assert [seq for seq, *_ in batches] == list(range(5100, 5200))
    finally:
        pub.close()
        context.destroy(linger=0)
