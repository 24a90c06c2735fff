"""KV cache groups: how the layers of a model with full and sliding-window layers share the cache's rows.

A model whose layers all attend alike (all full, or all within one window) has one group: the cache is
[layers, blocks, ...] and a request's one block table serves every layer. A hybrid model (Gemma 2 and 3:
sliding layers between full ones) keeps far fewer tokens for its sliding layers than for its full ones,
so, as vLLM's hybrid allocator does, its layers are split by kind into groups of R layers, R the number
of full layers, and the groups share the cache's R rows:

  * the cache is [R, blocks, ...]; layer l reads and writes row `layer_row[l]` of its group's blocks;
  * a block id is one page of R rows, held by one group of one request; every group draws from one pool;
  * each request has one block table per group (`BlockTables`), all indexed by the same logical block
    (token position // block_size);
  * a sliding group holds a ring of at most `ring_blocks` blocks: logical block j lives in ring slot
    j % ring_blocks, which the request's block j + ring_blocks overwrites once it is out of the window.
    The ring holds every block a step can read or write: the window before the step's first token and a
    whole chunk (engine.config.EngineConfig.max_num_batched_tokens), so its size follows the window, not
    the request's length.

Gemma 3's 26 layers (4 full, 22 sliding) are one full group and six sliding groups of four rows (the last
has two rows no layer uses): the cache holds 4 layers' rows instead of 26, and a request's sliding groups
hold a ring each however long it grows. Prefix caching covers the full group of one-group models only (a
ring's blocks are overwritten), so it is off for hybrid models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdserve.engine.config import ModelConfig, UnsupportedModelError
from pdserve.engine.core.block_pool import blocks_for_tokens


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """Group 0 holds the full-attention layers (or, in a one-group model, every layer); the others hold
    sliding layers, `windows[g]` tokens each (0: full attention)."""

    num_rows: int
    windows: tuple[int, ...]  # per group
    layer_group: tuple[int, ...]  # per layer
    layer_row: tuple[int, ...]  # per layer

    @classmethod
    def of(cls, cfg: ModelConfig) -> KVGroups:
        """The groups of `cfg`'s layers, and of its draft layer (ModelConfig.draft_layer: one more layer of
        full attention, in one-group models of full attention only)."""
        windows = [cfg.window(i) for i in range(cfg.num_layers)]
        full = [i for i, w in enumerate(windows) if not w]
        if cfg.draft_layer and (len(full) != len(windows) or cfg.is_mla):
            raise UnsupportedModelError(
                "an EAGLE-3 draft layer needs a model whose layers all attend fully, without MLA"
            )
        if not full or len(full) == len(windows):  # one kind: every layer in one group
            layers = cfg.num_layers + bool(cfg.draft_layer)
            return cls(layers, (cfg.widest_window,), (0,) * layers, tuple(range(layers)))
        rows = len(full)
        group, row, group_windows = [0] * len(windows), [0] * len(windows), [0]
        for r, layer in enumerate(full):
            row[layer] = r
        for window in sorted({w for w in windows if w}):  # each window's layers fill groups of R rows
            for n, layer in enumerate(i for i, w in enumerate(windows) if w == window):
                if n % rows == 0:
                    group_windows.append(window)
                group[layer], row[layer] = len(group_windows) - 1, n % rows
        return cls(rows, tuple(group_windows), tuple(group), tuple(row))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_identity(self) -> bool:
        """One group, layer l in row l: the cache is the plain stacked [layers, blocks, ...]."""
        return self.num_groups == 1

    def ring_blocks(self, block_size: int, max_chunk_tokens: int) -> tuple[int, ...]:
        """Blocks of each group's ring (0: group 0, which holds every block of a request). A step's row
        reads the window before its first token and writes up to `max_chunk_tokens`: ring slots must not
        collide over those positions' blocks."""
        return tuple(
            blocks_for_tokens(w - 1 + max_chunk_tokens, block_size) + 1 if g else 0
            for g, w in enumerate(self.windows)
        )

    def pieces(self, layer_start: int, num_layers: int) -> list[tuple[int, int, int]]:
        """Layers [layer_start, +num_layers) as maximal runs in one group on consecutive rows:
        (group, first row, layers), in layer order."""
        out: list[list[int]] = []
        for layer in range(layer_start, layer_start + num_layers):
            g, r = self.layer_group[layer], self.layer_row[layer]
            if out and out[-1][0] == g and out[-1][1] + out[-1][2] == r:
                out[-1][2] += 1
            else:
                out.append([g, r, 1])
        return [tuple(p) for p in out]


@dataclasses.dataclass(frozen=True)
class BlockTables:
    """A request's block table of each group, all as long (one entry per logical block); slicing slices
    every group's alike. A sliding group's entries repeat its ring's blocks."""

    groups: tuple[Sequence[int], ...]

    @classmethod
    def of(cls, block_ids: BlockTables | Sequence[int]) -> BlockTables:
        """Tables as they are, or a one-group model's plain block list."""
        if isinstance(block_ids, BlockTables):
            return block_ids
        return cls((tuple(int(b) for b in block_ids),))

    def __len__(self) -> int:
        return len(self.groups[0])

    def __getitem__(self, index: slice) -> BlockTables:
        return BlockTables(tuple(t[index] for t in self.groups))

    def to_lists(self) -> list[list[int]]:
        return [list(t) for t in self.groups]

    @classmethod
    def from_lists(cls, groups: Sequence[Sequence[int]]) -> BlockTables:
        return cls(tuple(tuple(int(b) for b in t) for t in groups))
