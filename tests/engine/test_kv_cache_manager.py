"""The block pool and the KV cache manager without JAX: reference counts, hashes, LRU eviction, and a
state machine over allocate / share / compute / free that checks the invariants after every step."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.config import ModelConfig
from pdserve.engine.core.block_pool import BlockPool, OutOfBlocksError, blocks_for_tokens
from pdserve.engine.core.host_pool import HostBlockPool
from pdserve.engine.core.kv_cache_manager import KVCacheManager, hash_block, hash_blocks
from pdserve.engine.core.kv_events import DEVICE, HOST, AllBlocksCleared, BlockRemoved, BlockStored
from pdserve.engine.core.kv_groups import KVGroups

pytestmark = pytest.mark.fast


def test_pool_allocate_release_and_double_free():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5 and pool.num_free == 3 and pool.num_used == 5
    with pytest.raises(OutOfBlocksError):
        pool.allocate(4)
    pool.release(blocks)
    assert pool.num_free == 8 and blocks_for_tokens(9, 4) == 3
    with pytest.raises(ValueError, match="freed twice"):
        pool.release(blocks[:1])
    pool.check()


def test_hashes_chain_on_every_token_before_and_on_the_adapter():
    a = hash_blocks(list(range(12)), 4)
    assert len(a) == 3 and hash_blocks(list(range(14)), 4) == a  # a partial block has no hash
    changed = hash_blocks([99, *range(1, 12)], 4)
    assert all(x != y for x, y in zip(a, changed, strict=True))  # the first block changes every later one
    assert hash_block(None, range(4, 8)) != a[1]  # the same tokens under another parent
    assert hash_blocks(list(range(12)), 4, extra_key="lora-fp") != a
    assert hash_blocks(list(range(12)), 4, start=a[:1]) == a  # continues a known chain


def test_lookup_returns_whole_blocks_and_never_the_last_token():
    kv = KVCacheManager(16, 4)
    prompt = list(range(12))
    assert kv.allocate("a", 12, token_ids=prompt)
    kv.cache_blocks("a", prompt, 12)
    a_blocks = kv.block_ids("a")
    assert kv.lookup(prompt) == a_blocks[:2]  # the third block holds the last token
    assert kv.lookup([*prompt, 50]) == a_blocks  # one more token: all three blocks are reusable
    assert kv.lookup([*prompt[:6], 7, 7, 7, 7, 7]) == a_blocks[:1]  # diverges inside block 2
    assert kv.lookup(prompt, extra_key="adapter") == []  # a LoRA request shares only its adapter's KV
    assert kv.lookup([9, *prompt[1:]]) == []


def test_shared_blocks_are_reference_counted_and_freed_tail_first_into_the_lru():
    kv = KVCacheManager(8, 4)
    prompt = list(range(9))  # 2 full blocks + 1 partial
    kv.allocate("a", 9, token_ids=prompt)
    kv.cache_blocks("a", prompt, 9)
    hits = kv.lookup(prompt)
    assert len(hits) == 2
    kv.allocate("b", 9, cached=hits, token_ids=prompt)
    assert kv.block_ids("b")[:2] == hits and kv.block_ids("b")[2] != kv.block_ids("a")[2]  # partial: own
    assert [kv.pool.ref_counts[b] for b in hits] == [2, 2]
    assert kv.stats.hits == 8 and kv.stats.queries == 18
    kv.free("a")  # b still holds the shared blocks
    assert [kv.pool.ref_counts[b] for b in hits] == [1, 1] and kv.pool.num_cached == 0
    kv.free("b")
    assert kv.pool.num_cached == 2 and kv.pool.num_used == 0
    assert list(kv.pool._lru) == hits[::-1]  # the tail block is evicted before the head
    kv.pool.check()


def test_allocation_takes_free_blocks_before_evicting_cached_ones():
    kv = KVCacheManager(4, 2)
    kv.allocate("a", 4, token_ids=[1, 2, 3, 4])
    kv.cache_blocks("a", [1, 2, 3, 4], 4)
    kv.free("a")  # 2 cached, 2 free
    assert kv.pool.num_free == 2 and kv.pool.num_cached == 2
    kv.allocate("b", 4)
    assert kv.pool.num_evictions == 0 and kv.lookup([1, 2, 3, 4, 5]) != []
    kv.allocate("c", 2)  # needs a cached block: the least recently used one goes (the tail, [3, 4])
    assert kv.pool.num_evictions == 1 and len(kv.lookup([1, 2, 3, 4, 5])) == 1
    assert kv.can_allocate("d", 2) and not kv.can_allocate("d", 4)  # 1 cached block left to evict
    kv.pool.check()


def test_unreferenced_hits_do_not_count_as_available_for_the_rest():
    kv = KVCacheManager(3, 2)
    kv.allocate("a", 4, token_ids=[1, 2, 3, 4])
    kv.cache_blocks("a", [1, 2, 3, 4], 4)
    kv.free("a")  # 2 cached + 1 free
    hits = kv.lookup([1, 2, 3, 4, 5])
    assert len(hits) == 2
    assert kv.can_allocate("b", 6, hits)  # 2 hits + 1 free
    assert not kv.can_allocate("b", 8, hits)  # a 4th block would have to evict one of its own hits
    assert not kv.allocate("b", 8, hits, [1, 2, 3, 4, 5, 6, 7])
    assert kv.pool.num_cached == 2 and kv.block_ids("b") == []  # a refused allocation changes nothing


def test_a_duplicate_block_stays_private_and_caching_can_be_off():
    kv = KVCacheManager(8, 2)
    for rid in ("a", "b"):  # the same prompt computed twice side by side (one batch)
        kv.allocate(rid, 4, token_ids=[1, 2, 3, 4])
    for rid in ("a", "b"):
        kv.cache_blocks(rid, [1, 2, 3, 4], 4)
    assert kv.lookup([1, 2, 3, 4, 5]) == kv.block_ids("a")  # the first copy is the cached one
    kv.free("b")
    assert kv.pool.num_free == 6 and kv.pool.num_cached == 0  # b's copies were never shared
    off = KVCacheManager(8, 2, enable_caching=False)
    off.allocate("a", 4, token_ids=[1, 2, 3, 4])
    off.cache_blocks("a", [1, 2, 3, 4], 4)
    off.free("a")
    assert off.lookup([1, 2, 3, 4, 5]) == [] and off.pool.num_free == 8


def test_sliding_groups_hold_a_ring_of_blocks_however_long_the_request_grows():
    """A hybrid model's rings (engine.core.kv_groups): the full group's table grows with the request, each
    sliding group's holds at most its ring, repeated over the logical blocks; nothing is cached."""
    sizes = dict(vocab_size=8, hidden_size=8, intermediate_size=4, num_heads=2, num_kv_heads=1, head_dim=2)
    model = ModelConfig(
        "gemma3",
        **sizes,
        num_layers=3,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        layer_windows=(24, 0, 24),
    )
    groups = KVGroups.of(model)
    assert (groups.num_rows, groups.windows, groups.layer_group, groups.layer_row) == (
        1,
        (0, 24, 24),
        (1, 0, 2),
        (0,) * 3,
    )
    rings = groups.ring_blocks(block_size=4, max_chunk_tokens=8)  # 23 + 8 tokens -> 8 blocks, + 1
    assert rings == (0, 9, 9)
    kv = KVCacheManager(64, 4, ring_blocks=rings)
    assert not kv.enable_caching and kv.lookup(list(range(20))) == []
    assert kv.allocate("a", 6, token_ids=list(range(6)))
    assert kv.pool.num_used == 2 + 2 * 2  # rings grow with the request up to their size
    assert not kv.can_allocate("a", 4 * 50) and kv.can_allocate("a", 4 * 40)  # 40 + 2 x 9 of 64
    assert kv.allocate("a", 4 * 40)
    tables = kv.block_tables("a")
    assert len(tables) == 40 and kv.pool.num_used == 40 + 2 * 9
    full, ring_1, ring_2 = tables.groups
    assert ring_1[:9] == ring_1[9:18] and ring_1[27:36] == ring_1[:9] and len(set(ring_1)) == 9
    assert not set(full) & set(ring_1) and not set(ring_1) & set(ring_2)
    assert tables[30:].groups[1] == ring_1[30:]  # slicing: every group alike
    kv.free("a")
    assert kv.pool.num_free == 64


def test_a_prefix_half_on_the_device_half_in_the_host_tier():
    """Blocks evicted from the device go to the host tier (tail first, as LRU frees them); a prompt finds
    its head on the device and the rest in the host tier, which gets new device blocks filled from its
    slots; events tell each medium's gains and losses."""
    kv = KVCacheManager(6, 2, host_blocks=4)
    kv.record_events()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 4 full blocks before the last token
    kv.allocate("a", len(a), (), a)
    kv.cache_blocks("a", a, len(a))
    blocks_a = kv.block_ids("a")
    kv.free("a")
    kv.take_events()
    kv.allocate("b", 6, (), [0] * 6)  # 3 blocks: the 2 free ones, then a's tail (its last 2 full blocks)...
    offloads = kv.take_offloads()
    assert [b for b, _ in offloads] == [blocks_a[3], blocks_a[2]][: len(offloads)] and len(offloads) == 1
    kv.allocate("c", 2, (), [0] * 2)  # ... and one more
    offloads += kv.take_offloads()
    assert [b for b, _ in offloads] == [blocks_a[3], blocks_a[2]]
    hashes = hash_blocks(a[:-1], 2)
    assert kv.lookup_host(hashes[2:]) == []  # in flight: not readable yet
    kv.offloads_landed([slot for _, slot in offloads])
    events = kv.take_events()
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in events] == [
        ("BlockRemoved", DEVICE, [hashes[3]]),
        ("BlockStored", HOST, [hashes[3]]),
        ("BlockRemoved", DEVICE, [hashes[2]]),
        ("BlockStored", HOST, [hashes[2]]),
    ]
    assert events[1].token_ids == a[6:8] and events[1].parent_hash == hashes[2]
    kv.free("b"), kv.free("c")
    hits = kv.lookup(a)
    assert hits == blocks_a[:2]
    slots = kv.lookup_host(hashes[2:])
    assert slots == [offloads[1][1], offloads[0][1]]  # in the prompt's order
    assert kv.allocate("a2", len(a), hits, a, slots)
    table = kv.block_ids("a2")
    assert table[:2] == blocks_a[:2]
    assert kv.take_loads() == [("a2", list(zip(slots, table[2:4], strict=True)))]
    assert kv.stats.hits == 8 and kv.stats.host_hits == 4
    assert kv.lookup(a) == table[:2]  # the loaded blocks enter the device's index once a step ran
    kv.cache_blocks("a2", a, len(a))
    assert kv.lookup(a) == table[:4]
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert [(e.medium, e.block_hashes) for e in stored] == [(DEVICE, hashes[2:4])]
    kv.free("a2")
    kv.pool.check(), kv.host.check()


def test_staging_reserves_host_slots_and_evicts_cached_ones():
    host = HostBlockPool(4)
    slot = host.store(7)
    host.landed([slot])
    assert host.reserve(3) and host.num_cached == 1
    assert host.reserve(1) and host.num_cached == 0 and host.lookup(7) is None  # evicted for staging
    assert not host.reserve(1)  # full: back-pressure
    host.unreserve(4)
    assert host.num_available == 4
    with pytest.raises(ValueError):
        host.unreserve(1)
    host.check()


class CacheMachine(RuleBasedStateMachine):
    """Requests over a 3-token alphabet (prefixes collide often) in a small cache. `written` records the
    tokens (with the whole prefix before them) each block's KV was computed for; every lookup hit must hold
    exactly the prefix it was found for.

    With HOST_SLOTS, a host tier under it (engine/core/host_pool.py): the copies the manager asks for are
    made as the engine makes them (the loads' slots read, the offloads' blocks read, the loads written, all
    before any step writes), an offload lands when a rule says so, and prefill streams reserve and give
    back staging slots. `host_written` records what each slot holds; a host hit must hold its prefix too."""

    BLOCK = 2
    DEVICE_BLOCKS = 12
    HOST_SLOTS = 0

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(self.DEVICE_BLOCKS, self.BLOCK, host_blocks=self.HOST_SLOTS)
        self.kv.record_events()
        self.published: dict[str, set[int]] = {DEVICE: set(), HOST: set()}  # what a reader believes
        self.requests: dict[str, list[int]] = {}  # holding blocks -> their tokens
        self.computed: dict[str, int] = {}
        self.written: dict[int, tuple[int, ...]] = {}
        self.host_written: dict[int, tuple[int, ...]] = {}
        self.in_flight: dict[int, tuple[int, ...]] = {}  # slot -> what its copy carries
        self.staged: list[int] = []
        self.history: list[tuple[list[int], str | None]] = []  # every prompt admitted, to send again
        self.ids = 0

    @rule(
        tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9),
        adapter=st.sampled_from([None, "x"]),
        landed=st.booleans(),
    )
    def admit(self, tokens, adapter, landed=False):
        """`landed`: the copies to the host tier under way land first (the engine takes them each step)."""
        while landed and self.in_flight:
            self.land_one(min(self.in_flight))
        self.history.append((tokens, adapter))
        rid = f"r{self.ids}"
        self.ids += 1
        hits = self.kv.lookup(tokens, adapter)
        loaded = self.kv.lookup_host(hash_blocks(tokens[:-1], self.BLOCK, adapter)[len(hits) :])
        for i, block in enumerate(hits):
            assert self.written[block] == (adapter, *tokens[: (i + 1) * self.BLOCK]), "stale cached block"
        for i, slot in enumerate(loaded, len(hits)):
            assert self.host_written[slot] == (adapter, *tokens[: (i + 1) * self.BLOCK]), "stale host block"
        if self.kv.allocate(rid, len(tokens), hits, tokens, loaded):
            assert self.kv.block_ids(rid)[: len(hits)] == hits
            self.requests[rid] = (adapter, tokens)
            self.computed[rid] = (len(hits) + len(loaded)) * self.BLOCK
        self._copy()
        if rid in self.requests:
            for i, block in enumerate(self.kv.block_ids(rid)[: len(hits) + len(loaded)]):
                assert self.written[block] == (adapter, *tokens[: (i + 1) * self.BLOCK])

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def again(self, data):  # a prompt sent before (the next turn of a conversation, a retry)
        self.admit(*data.draw(st.sampled_from(self.history)), landed=data.draw(st.booleans()))

    def land_one(self, slot):
        self.host_written[slot] = self.in_flight.pop(slot)
        self.kv.offloads_landed([slot])

    def _copy(self):
        """The engine's copies, in its order (ModelRunner.move_host_blocks)."""
        loads = [(self.host_written[s], block) for _, pairs in self.kv.take_loads() for s, block in pairs]
        for block, slot in self.kv.take_offloads():
            self.in_flight[slot] = self.written[block]
        for data, block in loads:
            self.written[block] = data

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def compute(self, data):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        adapter, tokens = self.requests[rid]
        done = data.draw(st.integers(self.computed[rid], len(tokens)))
        blocks = self.kv.block_ids(rid)
        for pos in range(self.computed[rid], done):  # the step writes these tokens' KV
            block = blocks[pos // self.BLOCK]
            assert self.kv.pool.ref_counts[block] == 1, "wrote into a shared block"
            self.written[block] = (adapter, *tokens[: (pos // self.BLOCK + 1) * self.BLOCK])
        self.computed[rid] = done
        self.kv.cache_blocks(rid, tokens, done, adapter, lora_name=adapter)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data):  # finish, abort or preempt: all give their references back
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.kv.free(rid)
        del self.requests[rid], self.computed[rid]

    @invariant()
    def events_tell_a_reader_exactly_what_is_cached(self):
        for event in self.kv.take_events():
            if isinstance(event, AllBlocksCleared):
                for held in self.published.values():
                    held.clear()
                continue
            held = self.published[event.medium]
            if isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= held
                held -= set(event.block_hashes)
                continue
            if event.medium == DEVICE:  # (a host block's parent may have left both tiers)
                assert event.parent_hash is None or event.parent_hash in held
            tokens = event.token_ids
            assert len(tokens) == len(event.block_hashes) * self.BLOCK
            start = [] if event.parent_hash is None else [event.parent_hash]
            # the hashes are the chain of these tokens after the parent, with the adapter
            assert (
                hash_blocks([0] * len(start) * self.BLOCK + tokens, self.BLOCK, event.lora_name, start)[
                    len(start) :
                ]
                == event.block_hashes
            )
            assert not set(event.block_hashes) & held
            held |= set(event.block_hashes)
        assert self.published[DEVICE] == set(self.kv.pool._by_hash)
        host = self.kv.host
        assert self.published[HOST] == (set(host._by_hash) if host else set())

    @invariant()
    def consistent(self):
        self.kv.pool.check()
        held = [b for rid in self.requests for b in self.kv.block_ids(rid)]
        for b in range(self.kv.num_blocks):
            assert self.kv.pool.ref_counts[b] == held.count(b)
        if self.kv.host is not None:
            self.kv.host.check()
            assert self.kv.host.num_staged == sum(self.staged)
            assert set(self.in_flight) == self.kv.host._in_flight


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_cache_state_machine = CacheMachine.TestCase


class TieredCacheMachine(CacheMachine):
    DEVICE_BLOCKS = 6  # (evictions often)
    HOST_SLOTS = 5

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def land(self, data):
        self.land_one(data.draw(st.sampled_from(sorted(self.in_flight))))

    @rule(num=st.integers(1, 4))
    def stage(self, num):
        available = self.kv.host.num_available
        assert self.kv.host.reserve(num) == (num <= available)
        if num <= available:
            self.staged.append(num)

    @precondition(lambda self: self.staged)
    @rule()
    def unstage(self):
        self.kv.host.unreserve(self.staged.pop(0))


TieredCacheMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
test_two_tier_cache_state_machine = TieredCacheMachine.TestCase
