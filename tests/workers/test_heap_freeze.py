import gc
import time
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


def test_full_passes_still_free_old_cyclic_garbage_after_a_freeze(freezer):
    # A large frozen heap (the master froze ~270k objects) makes CPython wait for a quarter of
    # that many objects to grow old before it runs a full pass by itself: without one run
    # between requests, every cycle below outlived its collection and stayed.
    heap = [[index] for index in range(300_000)]
    freezer.between_requests(warmed_up=True)
    alive, held = weakref.WeakSet(), []
    for _ in range(400):  # requests
        node = Node()
        node.self = node
        alive.add(node)
        held.append(node)  # kept over ~60 young collections: it grows old, then dies
        if len(held) > 20:
            held.pop(0)
        churn = [[] for _ in range(2100)]  # three young collections' worth of new containers
        del churn
        freezer.between_requests()
    # 20 held, plus what died since the last full pass (one is due every ~33 requests).
    assert len(alive) < 100, f"{len(alive)} of 400 cycles never freed"
    assert freezer.full_passes > 0
    del heap


def test_a_pass_that_waits_for_the_cpu_is_not_slow(freezer):
    # On a loaded machine a full pass is stretched by other processes; only the collecting
    # thread's CPU time says the heap grew. The sleep stands in for the wait.
    gc.freeze()  # pytest's own heap: the pass below walks almost nothing
    freezer.slow_pass_s = 0.05

    def wait_for_the_cpu(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            time.sleep(0.2)

    gc.callbacks.append(wait_for_the_cpu)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(wait_for_the_cpu)
    freezer.between_requests()
    assert freezer.freezes == 0


def rolling_cache_alive(freezer: HeapFreezer, steps: int = 600, cache_size: int = 100) -> int:
    """How many cyclic objects survive when a cache keeps the newest `cache_size` of them, one
    added per step (wandb's last 100 logged tables), with every full pass slow (a loaded
    machine) and one every 25 steps."""
    alive, cache = weakref.WeakSet(), []
    freezer.between_requests(warmed_up=True)
    for step in range(steps):
        node = Node()
        node.self = node
        alive.add(node)
        cache.append(node)
        if len(cache) > cache_size:
            cache.pop(0)  # evicted: garbage once a collection walks it
        if step % 25 == 0:
            gc.collect()
        freezer.between_requests()
    del cache
    gc.collect()
    return len(alive)


def test_the_masters_freezer_lets_evicted_cache_entries_die(freezer):
    freezer.close()
    master = HeapFreezer.for_master()
    master.slow_pass_s = 0.0  # every pass slow: the master still freezes only once
    try:
        left = rolling_cache_alive(master)
    finally:
        master.close()
    assert master.freezes == 1
    assert left <= 1  # at most the one alive at the warm-up freeze


def test_refreezing_pins_a_rolling_cache_that_later_dies(freezer):
    # Why the master does not re-freeze: each freeze pins the 100 entries then alive.
    freezer.slow_pass_s = 0.0
    left = rolling_cache_alive(freezer)
    assert freezer.freezes > 10
    assert left > 400
