"""A runner's KV in and out (engine.core.kv_connector's worker side): a request's blocks gathered into
kvtransfer chunks, and arriving chunks written into blocks, each layer through its group's block table
(engine.core.kv_groups)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from pdserve import kvtransfer
from pdserve.engine import multihost
from pdserve.engine.core.kv_groups import BlockTables
from pdserve.kvtransfer import HeadMap, KVChunk, KVLayout
from pdserve.kvtransfer.plan import FramePlan


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
        if self.groups.is_identity:
            self.cache = kvtransfer.insert(self.cache, chunk, tables.groups[0])
            return
        done = 0
        for group, row, count in self.groups.pieces(chunk.layer_start, chunk.num_layers):
            piece = dataclasses.replace(chunk, layer_start=row, data=chunk.data[done : done + count])
            self.cache = kvtransfer.insert(self.cache, piece, tables.groups[group])
            done += count
