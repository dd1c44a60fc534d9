"""Step buckets: the static shapes of the compiled step programs, their default ladder, and which bucket a
batch takes.

A bucket is ``(num_tokens, num_reqs)``, whether it is a pure-decode bucket, and for a mixed bucket how
many prefill rows it holds. Every bucket is one program per sampling variant to compile at start-up
(~6 s each on an H100 for an 8B model), so the default ladder is short: at vLLM's serving defaults
(``max_num_seqs=256, max_num_batched_tokens=8192``) 18 buckets and 24 programs on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxmamba.errors import ConfigError, MetadataError
from jaxmamba.sampling import FULL, GREEDY, SamplingVariant


@dataclass(frozen=True, order=True)
class Bucket:
    """Static shapes of one compiled step.

    ``num_prefills`` (``P``) sizes the Mamba prefill path: the SSD chunk arrays, the gathered
    initial/final states and the varlen-conv rows follow the prefill rows a bucket holds, not its
    request rows (a mixed step of 250 decodes and 2 prompt chunks needs 2 rows of SSD state, not
    256). ``None`` means every row (``P = R``); decode buckets have ``P = 0``.
    """

    num_tokens: int  # T: padded tokens (sorted first: the smallest bucket that fits wins)
    num_reqs: int  # R: padded rows
    decode_only: bool = False
    num_prefills: int | None = None  # P: prefill rows (mixed buckets)

    def __post_init__(self):
        if self.decode_only:
            p = 0
        else:
            p = self.num_reqs if self.num_prefills is None else int(self.num_prefills)
            if not 1 <= p <= self.num_reqs:
                raise ConfigError(f"a mixed bucket's num_prefills={p} must be in [1, num_reqs={self.num_reqs}]")
        object.__setattr__(self, "num_prefills", p)

    def fits(self, num_reqs: int, num_tokens: int, num_prefills: int = 0) -> bool:
        return num_reqs <= self.num_reqs and num_tokens <= self.num_tokens and num_prefills <= self.num_prefills


#: Rungs per ladder dimension (decode rows, mixed tokens) before the ladder coarsens: a power-of-two
#: ladder where it has at most this many rungs (small engines, the tests' and ``bench serve``'s, keep every
#: rung), else rungs 4x apart plus the top one's half.
MAX_RUNGS = 6


def _geometric_upto(n: int, start: int, ratio: int) -> list[int]:
    out, v = [], start
    while v < n:
        out.append(v)
        v *= ratio
    return out + [n]


def _pow2_upto(n: int, start: int = 1) -> list[int]:
    return _geometric_upto(n, start, 2)


def ladder(start: int, top: int, max_rungs: int = MAX_RUNGS) -> list[int]:
    """Sizes ``start, 2 start, 4 start, ..., top`` if that is at most ``max_rungs`` sizes, else ``start, 4 start,
    16 start, ..., top`` and ``top // 2`` unless a rung already lies in ``[top / 2, top)``: a loaded engine runs
    near the top, where a rung 4x below would pad most (a batch of 65 rows would pay for 256)."""
    pow2 = _pow2_upto(top, start)
    if len(pow2) <= max_rungs:
        return pow2
    rungs = _geometric_upto(top, start, 4)
    if not any(2 * r >= top for r in rungs[:-1]):
        rungs.append(max(start, top // 2))
    return sorted(set(rungs))


def prefill_rows_ladder(num_reqs: int, num_tokens: int = 0, top: bool = False) -> list[int]:
    """Prefill-row counts ``P`` of the mixed buckets with ``R = num_reqs`` rows and ``T = num_tokens`` tokens: ``R``
    itself (a burst of new prompts) and 4 where ``R`` is at least 8x larger (the steady state of continuous
    batching: many decodes, a few prompt chunks; below 32 rows the all-prefill bucket costs little more). ``top``:
    ``T`` is the token budget's rung, where a loaded engine's admissions land (a step that admits prompts fills the
    budget): there also ``middle_prefill_rows(T)``, so that a step of 5-16 prompt chunks does not carry ``R`` rows of
    SSD chunks and states (each prefill row opens a chunk: at ``R = 128`` the all-prefill bucket ran 2.7x the 4-row
    one's time on the CPU; BENCHMARKS.md, "Session 29"). Few rungs: every bucket is one more compile."""
    rungs = {p for p in (4,) if 8 * p <= num_reqs} | {num_reqs}
    if top and 4 * (middle := middle_prefill_rows(num_tokens)) <= num_reqs:
        rungs.add(middle)
    return sorted(rungs)


def middle_prefill_rows(num_tokens: int) -> int:
    """The top token rung's middle prefill-row count: 8, or one prompt chunk per 512 tokens of a larger budget (a
    power of two: 16 at 8192 tokens), the prefill rows a full step of long prompts' chunks holds."""
    return max(8, 1 << max(0, (num_tokens // 512).bit_length() - 1))


def default_buckets(max_num_seqs: int, max_num_batched_tokens: int, num_spec: int = 0) -> tuple[Bucket, ...]:
    """Pure-decode buckets at ``R = ladder(1, max_num_seqs)`` rows; mixed buckets at ``T = ladder(16,
    max_num_batched_tokens)`` tokens and ``R = min(T, max_num_seqs)`` rows (a mixed batch of ``T`` tokens has
    at most ``T`` rows), each at the prefill-row counts of ``prefill_rows_ladder(R, T)`` (a middle count at the top
    ``T``): a small mixed step does not carry ``max_num_seqs`` rows of per-row arrays, nor a mostly-decode step
    ``R`` rows of SSD chunks and states."""
    per_row = 1 + num_spec
    decode = [Bucket(r * per_row, r, True) for r in ladder(1, max_num_seqs)]
    mixed = [Bucket(t, r, False, p) for t in ladder(16, max_num_batched_tokens)
             for r in (min(t, max_num_seqs),) for p in prefill_rows_ladder(r, t, t == max_num_batched_tokens)]
    return tuple(sorted(set(decode + mixed)))


def engine_buckets(max_num_seqs: int, max_num_batched_tokens: int, num_spec: int = 0,
                   buckets=None) -> tuple[Bucket, ...]:
    """The engine's bucket set: ``default_buckets``, or explicit mixed buckets as ``(num_reqs, num_tokens)``
    pairs (every row may be a prefill) or ``(num_reqs, num_tokens, num_prefills)`` triples; one of them
    must hold ``max_num_seqs`` rows, all of them prefills, and ``max_num_batched_tokens`` tokens."""
    if buckets is None:
        return default_buckets(max_num_seqs, max_num_batched_tokens, num_spec)
    bucket_set = []
    for entry in buckets:
        try:
            r, t, *p = (int(v) for v in entry)
            if len(p) > 1:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"bucket {entry!r} must be (num_reqs, num_tokens) or (num_reqs, num_tokens, "
                              "num_prefills)") from None
        bucket_set.append(Bucket(t, r, False, p[0] if p else None))
    bucket_set = tuple(sorted(set(bucket_set)))
    if not any(b.fits(max_num_seqs, max_num_batched_tokens, max_num_seqs) for b in bucket_set):
        raise ConfigError("buckets must include one holding max_num_seqs rows (all prefills) and "
                          "max_num_batched_tokens tokens")
    return bucket_set


def select_bucket(buckets: tuple[Bucket, ...], num_reqs: int, num_tokens: int, decode_only: bool,
                  num_prefills: int | None = None, *, ranked: bool = False) -> Bucket:
    """The smallest bucket holding the batch. A decode-only batch takes a decode bucket whenever one
    holds it (a mixed bucket of the same size would run the prefill kernels for nothing); mixed
    batches take mixed buckets with room for their ``num_prefills`` prefill rows (default: every row).
    ``ranked``: ``buckets`` are already in ``rank_buckets`` order (a caller that selects every step ranks once)."""
    need_p = 0 if decode_only else (num_reqs if num_prefills is None else num_prefills)
    # The first that fits in rank order is the smallest: the search stops there.
    for b in buckets if ranked else rank_buckets(buckets):
        if b.fits(num_reqs, num_tokens, need_p) and (decode_only or not b.decode_only):
            return b
    raise MetadataError(f"no bucket holds {num_reqs} requests ({need_p} prefills) / {num_tokens} tokens "
                        f"(buckets: {buckets})")


def rank_buckets(buckets) -> tuple[Bucket, ...]:
    """``buckets`` smallest first, as ``select_bucket`` prefers them: decode buckets before mixed ones (Bucket's
    own order puts decode_only=False first on equal sizes), then by tokens, rows and prefill rows."""
    return tuple(sorted(buckets, key=lambda b: (not b.decode_only, b.num_tokens, b.num_reqs, b.num_prefills)))



#: Engine arg ``sampling_variants``: which buckets also get the greedy-only sampling tail.
#: "auto": the buckets where the full tail is a large share of the step (``wants_greedy_tail``: on a GPU only);
#: "decode": pure-decode buckets only; "all": every bucket; "full": none (one program per bucket, the fewest
#: compilations).
SAMPLING_VARIANT_POLICIES = ("auto", "decode", "all", "full")

#: Rows from which a bucket gets the greedy tail under "auto": the full tail sorts the vocabulary of every
#: row, which at 256 rows cost a greedy workload more than its prefill (bench serve on the tiny default:
#: 3,641 output tok/s with the full tail on mixed steps, 9,670 with the greedy one); below it the tail of a
#: few rows is small beside the step and a second program would only cost start-up time.
GREEDY_TAIL_MIN_ROWS = 16


def check_sampling_variants(policy: str) -> None:
    """Raise ``ConfigError`` unless ``policy`` is one of ``SAMPLING_VARIANT_POLICIES``."""
    if policy not in SAMPLING_VARIANT_POLICIES:
        raise ConfigError(f"sampling_variants={policy!r} must be one of {SAMPLING_VARIANT_POLICIES}")


def wants_greedy_tail(bucket: Bucket, platform: str = "gpu") -> bool:
    """Policy "auto": on a GPU, a bucket of at least ``GREEDY_TAIL_MIN_ROWS`` rows of about one token each (a
    decode bucket, or a mixed one of at most a token a row whose prefill rows are at most a quarter of its rows:
    the steady state of continuous batching), where the per-row tail weighs most beside the forward pass.

    On the CPU (``platform="cpu"``) no bucket: there the full tail on greedy rows costs what the argmax does
    (the candidate-set filter sorts nothing, and ``jaxmamba.cpu_heap`` keeps its large temporaries from
    page-faulting: 1.06x the greedy step at 32 rows of a 32,768-token vocabulary, 0.93x for the tail alone at
    128; BENCHMARKS.md, session 13), while each second program costs ~15 s of start-up (a quarter of the
    programs at (256, 2048)). On a GPU the full tail still costs 1.22-1.24x the greedy decode step (H200,
    session 11)."""
    if platform == "cpu" or bucket.num_reqs < GREEDY_TAIL_MIN_ROWS:
        return False
    return bucket.decode_only or (bucket.num_tokens <= bucket.num_reqs and 4 * bucket.num_prefills <= bucket.num_reqs)


def bucket_sampling_variants(bucket: Bucket, policy: str = "auto", platform: str = "gpu"
                             ) -> tuple[SamplingVariant, ...]:
    """The sampling variants compiled for ``bucket`` under ``policy`` on ``platform`` (a JAX platform name:
    "auto" depends on it, see ``wants_greedy_tail``), cheapest first (``FULL`` always)."""
    check_sampling_variants(policy)
    greedy = (policy == "all" or (policy == "decode" and bucket.decode_only)
              or (policy == "auto" and wants_greedy_tail(bucket, platform)))
    return (GREEDY, FULL) if greedy else (FULL,)
