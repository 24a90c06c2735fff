"""A runner's KV in and out (engine.core.kv_connector's worker side): a request's blocks gathered into
kvtransfer chunks, and arriving chunks written into blocks, each layer through its group's block table
(engine.core.kv_groups)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from pdserve import kvtransfer
from pdserve.engine import multihost
from pdserve.engine.core.kv_groups import BlockTables
from pdserve.kvtransfer import HeadMap, KVChunk, KVLayout
from pdserve.kvtransfer.plan import FramePlan, cdiv


class RunnerKVIO:
    """ModelRunner's KV reads and writes (mixed into it: it uses the runner's cache, layout, groups, mesh
    and publish)."""

    def gather_kv(
        self,
        layout: KVLayout,
        block_ids: BlockTables | Sequence[int],
        num_tokens: int,
        *,
        max_frame_bytes: int,
        head_map: HeadMap | None,
        frames: Sequence[FramePlan],
    ) -> list[KVChunk]:
        """kvtransfer's chunks of these frames of a request's blocks (engine.core.kv_groups: each layer read
        from its group's table and its row); in a multi-process job the chunks are replicated on every process
        (an all-gather over the hosts), so the leader reads them locally."""
        tables = BlockTables.of(block_ids)
        if self.publish is not None:
            self.publish(multihost.gather_op(tables, num_tokens, max_frame_bytes, head_map, frames))
        if self.groups.is_identity:
            chunks = kvtransfer.gather_request(
                self.cache,
                layout,
                tables.groups[0],
                num_tokens,
                max_frame_bytes=max_frame_bytes,
                head_map=head_map,
                frames=frames,
            )
        else:
            chunks = [self._gather_frame(tables, p, head_map) for p in frames]
        if multihost.is_multi_process():
            chunks = [dataclasses.replace(c, data=self._replicated(c.data)) for c in chunks]
            jax.block_until_ready([c.data for c in chunks])  # no collective may overlap the next step's
        return chunks

    def _gather_frame(self, tables: BlockTables, p: FramePlan, head_map: HeadMap | None) -> KVChunk:
        """One frame of a hybrid model's cache: its layers' runs of rows, each with its group's blocks."""
        ids = tables[p.block_start : p.block_start + p.num_blocks]
        parts = [
            kvtransfer.gather(
                self.cache,
                ids.groups[group],
                p.num_tokens,
                layer_start=row,
                num_layers=count,
                token_start=p.token_start,
                head_map=head_map,
                bucket=p.bucket,
            ).data
            for group, row, count in self.groups.pieces(p.layer_start, p.num_layers)
        ]
        data = parts[0] if len(parts) == 1 else jax.numpy.concatenate(parts)
        return KVChunk(p.layer_start, p.token_start, p.num_tokens, data)

    def warmup_kv_io(
        self,
        layout: KVLayout,
        max_tokens: int,
        max_frame_bytes: int,
        head_map: HeadMap | None = None,
        receiver: RunnerKVIO | None = None,
        insert: bool = True,
    ) -> int:
        """Runs every gather and insert kernel a transfer in this frame plan can reach (requests of up to
        `max_tokens` tokens), so that serving compiles none: each distinct frame read from a
        contiguous run and from scattered blocks, sent through host memory as the wire does, and written
        into `receiver` (default this runner) at the blocks it was read from. Without a head map the
        cache is written with what it held; a receiver other than this runner gets this cache's bytes in
        its blocks, so warm it before it holds any request. `insert` False: the gathers only (a sender
        that never receives). Returns the number of transfers run."""
        receiver = self if receiver is None else receiver
        num_blocks = min(jax.tree.leaves(c)[0].shape[-4] for c in (self.cache, receiver.cache))
        runs = 0
        for frame in kvtransfer.distinct_frames(layout, cdiv(max_tokens, layout.block_size), max_frame_bytes):
            if frame.num_blocks > num_blocks:
                continue  # no request this long fits the cache
            ids = list(range(frame.num_blocks))
            for order in (ids, ids[::-1]) if len(ids) > 1 else (ids,):  # a run (sliced), scattered (taken)
                tables = BlockTables((tuple(order),) * self.groups.num_groups)
                args = dict(max_frame_bytes=max_frame_bytes, head_map=head_map, frames=[frame])
                (chunk,) = self.gather_kv(layout, tables, frame.num_tokens, **args)
                if insert:
                    receiver.insert_kv(dataclasses.replace(chunk, data=np.asarray(chunk.data)), tables)
                runs += 1
        return runs

    def insert_kv(self, chunk: KVChunk, block_ids: BlockTables | Sequence[int]) -> None:
        """Writes an arriving chunk (heads in this cache's layout; on the mesh already, or a host array put
        on it here) into a request's blocks (each layer into its group's table and its row). A
        multi-process engine takes host arrays only (every process puts its own shards)."""
        tables = BlockTables.of(block_ids)
        if isinstance(chunk.data, np.ndarray):
            if self.publish is not None:
                self.publish(multihost.insert_op(chunk, tables))
            data = jax.device_put(chunk.data, kvtransfer.chunk_sharding(self.mesh, self.layout))
            chunk = dataclasses.replace(chunk, data=data)
        elif self.publish is not None:
            raise ValueError("a multi-process engine inserts host chunks only")
        for piece, table in self._insert_pieces(chunk, tables):
            self.cache = kvtransfer.insert(self.cache, piece, table)

    def _insert_pieces(self, chunk: KVChunk, tables: BlockTables) -> Iterator[tuple[KVChunk, Sequence[int]]]:
        """The inserts of a chunk: each run of its layers with the block table of their group (at its row)."""
        if self.groups.is_identity:
            yield chunk, tables.groups[0]
            return
        done = 0
        for group, row, count in self.groups.pieces(chunk.layer_start, chunk.num_layers):
            yield (
                dataclasses.replace(chunk, layer_start=row, data=chunk.data[done : done + count]),
                tables.groups[group],
            )
            done += count

    def compile_inserts(self, src: KVLayout, max_tokens: int, max_frame_bytes: int) -> int:
        """Compiles, without running them, the inserts of the chunks a peer of layout `src` sends from the
        wire (its frame plan for requests of up to `max_tokens` tokens; heads converted to this layout, on
        this mesh). Safe off the engine thread: the cache is only described (its shapes and shardings),
        never read. Returns how many chunk shapes."""
        frames = kvtransfer.distinct_frames(src, cdiv(max_tokens, src.block_size), max_frame_bytes)
        leaf = jax.tree.leaves(self.cache)[0]
        cache = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.cache
        )
        sharding = kvtransfer.chunk_sharding(self.mesh, self.layout)
        num_blocks, block_size = leaf.shape[-4], leaf.shape[-3]
        compiled = 0
        for frame in frames:
            if frame.num_blocks > num_blocks:
                continue  # no request this long fits the cache
            shape = (frame.num_layers, frame.bucket * block_size, *leaf.shape[-2:])
            # a real array, not a ShapeDtypeStruct: a hybrid model's pieces slice it
            data = jax.device_put(np.zeros(shape, leaf.dtype), sharding)
            chunk = KVChunk(frame.layer_start, 0, frame.num_tokens, data)
            tables = BlockTables((tuple(range(frame.num_blocks)),) * self.groups.num_groups)
            for piece, table in self._insert_pieces(chunk, tables):
                kvtransfer.compile_insert(cache, piece, table)
            compiled += 1
        return compiled
