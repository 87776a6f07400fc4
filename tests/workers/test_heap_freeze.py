import gc
import weakref

import pytest

from realrl.workers.heap_freeze import HeapFreezer


class Node:
    pass


def cyclic_garbage() -> weakref.ref:
    """An unreachable reference cycle only a collection frees; a weak reference to watch it."""
    node = Node()
    node.self = node
    return weakref.ref(node)


@pytest.fixture
def freezer():
    gc.collect()
    gc.unfreeze()
    freezer = HeapFreezer()
    yield freezer
    freezer.close()
    gc.unfreeze()


def test_nothing_happens_between_ordinary_requests(freezer):
    freezer.between_requests()
    assert freezer.freezes == 0
    assert gc.get_freeze_count() == 0


def test_warm_up_collects_then_freezes(freezer):
    survivors = [Node() for _ in range(100)]
    garbage = cyclic_garbage()
    freezer.between_requests(warmed_up=True)
    assert garbage() is None  # collected, not frozen
    assert freezer.freezes == 1
    assert gc.get_freeze_count() >= len(survivors)
    # Frozen objects are out of every generation a collection walks.
    assert not any(obj is survivors[0] for obj in gc.get_objects())


def test_slow_full_pass_freezes_what_it_left(freezer):
    freezer.slow_pass_s = 0.0  # every full pass counts as slow
    gc.collect()  # a full pass: the freeze is now due
    garbage = cyclic_garbage()
    freezer.between_requests()
    assert freezer.freezes == 1
    assert gc.get_freeze_count() > 0
    # No second collection: a cycle made after the slow pass is frozen with the rest.
    assert garbage() is not None
    freezer.between_requests()
    assert freezer.freezes == 1  # due once per slow pass


def test_fast_full_passes_do_not_freeze(freezer):
    freezer.slow_pass_s = 60.0
    gc.collect()
    freezer.between_requests()
    assert freezer.freezes == 0


def test_close_stops_watching(freezer):
    freezer.slow_pass_s = 0.0
    freezer.close()
    gc.collect()
    freezer.between_requests()
    assert freezer.freezes == 0
