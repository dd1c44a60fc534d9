"""The serving loops run with the start-up heap frozen (engine.gc_heap), and give it back unfrozen."""

import gc
import weakref

import pytest

from jaxmamba import SamplingParams
from jaxmamba.engine.gc_heap import frozen_heap, startup_frozen


@pytest.fixture(autouse=True)
def _no_freeze_left():
    # The interpreter may freeze objects of its own at start-up (CPython 3.12: 375): a caller's freeze is more.
    assert gc.get_freeze_count() <= startup_frozen, "a test before this one left the heap frozen"
    yield
    gc.unfreeze()


def _frozen(obj) -> bool:
    """``obj`` sits in the permanent generation, which collections (and ``gc.get_objects``) skip."""
    return not any(o is obj for o in gc.get_objects())


class _Node:
    pass


def test_objects_alive_on_entry_are_frozen_for_the_block_only():
    before = _Node()
    with frozen_heap():
        assert gc.get_freeze_count() > startup_frozen
        assert _frozen(before)
        made_inside = _Node()
        assert not _frozen(made_inside)  # collected as usual
    assert not _frozen(before)


def test_a_cycle_that_became_garbage_inside_the_block_is_collected_after_it():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    with frozen_heap():
        del a, b
        gc.collect()
        assert alive() is not None  # frozen: no collection reaches it
    gc.collect()
    assert alive() is None  # unfrozen on exit: nothing kept past the block


def test_nested_blocks_share_one_freeze():
    before = _Node()
    with frozen_heap():
        with frozen_heap():
            pass
        assert _frozen(before)  # the inner block's exit did not unfreeze
    assert not _frozen(before)


def test_a_heap_the_caller_froze_is_left_frozen():
    frozen_by_caller = _Node()
    gc.freeze()
    with frozen_heap():
        made_inside = _Node()
        assert not _frozen(made_inside)  # not frozen again on entry
    assert _frozen(frozen_by_caller)  # nor unfrozen on exit


def test_generate_steps_with_the_heap_frozen_and_unfreezes_it():
    from jaxmamba.bench.host_inputs import stubbed_llm

    llm = stubbed_llm(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    counts = []
    step = llm.llm_engine.engine_core.step

    def counting_step():
        counts.append(gc.get_freeze_count())
        return step()

    llm.llm_engine.engine_core.step = counting_step
    out = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    assert counts and min(counts) > startup_frozen
    assert gc.get_freeze_count() <= startup_frozen
