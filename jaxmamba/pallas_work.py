"""The contractions a Pallas kernel launch performs, from its grid, its block shapes and the batch it runs.

A compiled GPU program shows a Pallas kernel as one Triton custom call: its operands' and results' shapes,
its launch grid and its name, which carries the block shapes (``ssd_chunk_scan_cs128_bl64_bp64_bn32``: chunk
128, blocks of 64 rows, 64 head columns, 32 state columns). The SSD and attention kernels skip the tiles
that hold no real token (``pl.when`` on a chunk's length, a causal tile order, a key loop bounded by the
query tile's context), so their work depends on the batch: ``BatchShape`` says which rows the step holds
and where they start, and each formula counts the tiles the kernel runs for it, tile by tile, as the
kernel's code does (the tiles' padding rows included: that is work the kernel does).

Counted: multiply-adds of the kernels' ``dot``s (2 FLOPs each) and, for the decode-side state update and
the depthwise convolutions, their products with the state / the filter taps (the work a batch needs there
is the same kind: ``jaxmamba.roofline.batch_flops``). ``KERNEL_WORK`` maps a kernel name's stem to its formula;
a kernel without one is reported as unknown by ``jaxmamba.hlo_flops``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from jaxmamba.errors import ConfigError
from jaxmamba.metadata.mamba_builder import compute_chunk_metadata


@dataclass(frozen=True)
class BatchShape:
    """The rows of one step: new tokens, tokens already computed before them, and whether the row is a prefill
    (its tokens go through the SSD chunks and the varlen convolution) or a decode row (the state update)."""

    new_tokens: tuple[int, ...]
    computed: tuple[int, ...]
    prefill: tuple[bool, ...]

    def __post_init__(self):
        if not (len(self.new_tokens) == len(self.computed) == len(self.prefill)):
            raise ConfigError("BatchShape: new_tokens, computed and prefill must have one entry a row")
        if any(n < 1 for n in self.new_tokens) or any(c < 0 for c in self.computed):
            raise ConfigError(f"BatchShape: every row needs >= 1 new token and >= 0 computed tokens, got "
                              f"{self.new_tokens} / {self.computed}")

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)

    def chunk_lengths(self, chunk_size: int) -> list[int]:
        """Real tokens of every SSD chunk of the prefill rows (chunks aligned as the engine aligns them)."""
        rows = [(c, n) for c, n, p in zip(self.computed, self.new_tokens, self.prefill, strict=True) if p]
        if not rows:
            return []
        cu, _, _ = compute_chunk_metadata([c for c, _ in rows], [n for _, n in rows], chunk_size)
        return [int(b - a) for a, b in zip(cu[:-1], cu[1:], strict=True)]

    @property
    def num_decodes(self) -> int:
        return sum(1 for p in self.prefill if not p)


@dataclass(frozen=True)
class KernelCall:
    """What a formula sees of one launch: the kernel's name, its operands' and results' dims, the grid."""

    name: str
    operands: list[list[int]]
    results: list[list[int]]
    grid: tuple[int, int, int]

    def block(self, key: str) -> int:
        m = re.search(rf"_{key}(\d+)(?:_|$)", self.name)
        if m is None:
            raise ConfigError(f"kernel {self.name!r} names no {key} block size")
        return int(m.group(1))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ssd_bmm(call: KernelCall, batch: BatchShape) -> int:
    # result f32[nc, G, cs, cs]; operand 1: C [T, G, N]. Tiles (rb, kb) with kb <= rb inside the chunk.
    cs, bm = call.block("cs"), call.block("bm")
    groups, d_state = call.results[0][1], call.operands[1][-1]
    tiles = sum(nb * (nb + 1) // 2 for nb in (_cdiv(n, bm) for n in batch.chunk_lengths(cs)))
    return 2 * tiles * bm * bm * d_state * groups


def _ssd_chunk_state(call: KernelCall, batch: BatchShape) -> int:
    # result f32[nc, H, P, N]; per program (chunk, head, P x N tile): cdiv(len, bl) blocks of bl rows.
    cs, bl = call.block("cs"), call.block("bl")
    _, heads, head_dim, d_state = call.results[0]
    rows = sum(_cdiv(n, bl) * bl for n in batch.chunk_lengths(cs))
    return 2 * rows * head_dim * d_state * heads


def _ssd_chunk_scan(call: KernelCall, batch: BatchShape) -> int:
    # result [T, H, P]; operand 4: CB f32[nc, G, cs, cs]; operand 3: C [T, G, N]. Row block m of a chunk runs
    # m + 1 (bl x bl) x (bl x P) products and its (bl x N) x (N x P) product with the entering state.
    cs, bl = call.block("cs"), call.block("bl")
    heads, head_dim = call.results[0][1], call.results[0][2]
    d_state = call.operands[3][-1]
    work = 0
    for n in batch.chunk_lengths(cs):
        blocks = _cdiv(n, bl)
        work += (blocks * (blocks + 1) // 2) * bl * bl * head_dim + blocks * bl * d_state * head_dim
    return 2 * work * heads


def _paged_attention_varlen(call: KernelCall, batch: BatchShape) -> int:
    # result [T + bq, Hkv * Gp, d]; per (query tile of one row, KV head): cdiv(tile context, bk) key tiles,
    # each QK^T and PV for bq tokens x Gp heads.
    bq, bk, groups = call.block("bq"), call.block("bk"), call.block("g")
    kv_heads = call.grid[1]
    head_dim = call.results[0][-1]
    gp = 1 << max(groups - 1, 0).bit_length()
    work = 0
    for n, computed in zip(batch.new_tokens, batch.computed, strict=True):
        for start in range(0, n, bq):
            context = computed + min(start + bq, n)
            work += _cdiv(context, bk) * bk
    return 2 * 2 * work * bq * gp * head_dim * kv_heads


def _selective_state_update(call: KernelCall, batch: BatchShape) -> int:
    # grid (rows, H, P tiles): every row's state is decayed and updated (B x) and read out (C h): 2 products of
    # P x N per head and token; results[0] is [T, H, P] and results[1] the state pool [slots, H, P, N].
    _, heads, head_dim, d_state = call.results[1]
    return 2 * 2 * call.grid[0] * heads * head_dim * d_state


def _conv_update(call: KernelCall, batch: BatchShape) -> int:
    # grid (rows, channel tiles); a row's token(s) times the K filter taps.
    return 2 * call.grid[0] * call.block("q") * call.results[0][-1] * call.block("k")


def _conv_varlen(call: KernelCall, batch: BatchShape) -> int:
    # grid (token tiles of bt over the prefill rows, channel tiles): every launched tile is bt tokens wide.
    return 2 * call.grid[0] * call.block("bt") * call.results[0][-1] * call.block("k")


#: Kernel-name stems (the name up to its block shapes) and their formulas.
KERNEL_WORK: dict[str, Callable[[KernelCall, BatchShape], int]] = {
    "ssd_bmm": _ssd_bmm,
    "ssd_chunk_state": _ssd_chunk_state,
    "ssd_chunk_scan": _ssd_chunk_scan,
    "ssd_chunk_cumsum": lambda call, batch: 0,  # prefix sums, no contraction
    "ssd_state_passing": lambda call, batch: 0,  # a decayed sum of chunk states, no contraction
    "paged_attention_varlen": _paged_attention_varlen,
    "selective_state_update": _selective_state_update,
    "causal_conv1d_update": _conv_update,
    "causal_conv1d_varlen": _conv_varlen,
}


def kernel_work(call: KernelCall, batch: BatchShape | None) -> int | None:
    """FLOPs of one launch of ``call`` on ``batch``; None for a kernel without a formula (or no batch)."""
    for stem, formula in KERNEL_WORK.items():
        if call.name.startswith(stem + "_") or call.name == stem:
            return None if batch is None else int(formula(call, batch))
    return None


def filling_batch(num_tokens: int, num_reqs: int, num_prefills: int, decode_context: int) -> BatchShape:
    """The batch that fills a mixed bucket ``(T, R, P)``: ``R - P`` decode rows of one token after
    ``decode_context`` computed tokens, and ``P`` prompts starting at position 0 sharing the other tokens as
    evenly as they can (the first ones one longer); ``P = R``: every row a prompt."""
    decodes = num_reqs - num_prefills
    prompt_tokens = num_tokens - decodes
    if num_prefills < 1 or decodes < 0 or prompt_tokens < num_prefills:
        raise ConfigError(f"no batch fills a bucket of {num_tokens} tokens, {num_reqs} rows and {num_prefills} "
                          "prefill rows (each prefill row needs a token, each decode row one)")
    base, extra = divmod(prompt_tokens, num_prefills)
    prompts = [base + (i < extra) for i in range(num_prefills)]
    return BatchShape(new_tokens=tuple(prompts + [1] * decodes),
                      computed=tuple([0] * num_prefills + [decode_context] * decodes),
                      prefill=tuple([True] * num_prefills + [False] * decodes))
