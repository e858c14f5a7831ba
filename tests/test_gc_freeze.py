"""`freeze_long_lived`: what is alive leaves the collector's view; garbage is collected first, so
none of it is kept forever."""

import gc
import weakref

from strop.gc_freeze import freeze_long_lived


class Node:
    pass


def test_freeze_long_lived_exempts_survivors_and_collects_garbage_first():
    kept = Node()
    garbage = Node()
    garbage.self = garbage  # a cycle: only the collector frees it
    gone = weakref.ref(garbage)
    del garbage
    try:
        freeze_long_lived()
        assert gone() is None
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # a full collection no longer visits it
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())
