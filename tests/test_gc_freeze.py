"""shared.gc_freeze: start-up objects leave the collector's generations, later garbage is still
collected. In a child process: freezing is process-wide."""
import subprocess
import sys

CHILD = r"""
import gc, weakref
from shared.gc_freeze import freeze_startup_objects

class Node:
    pass

startup = [Node() for _ in range(20000)]
frozen = freeze_startup_objects()
assert frozen >= 20000, frozen
tracked = {id(o) for o in gc.get_objects()}
assert not any(id(n) in tracked for n in startup), "a frozen object is still walked"

cycle = Node()
cycle.me = cycle
alive = weakref.ref(cycle)
del cycle
gc.collect()
assert alive() is None, "garbage made after the freeze was not collected"
print("ok", frozen)
"""


def test_startup_objects_are_frozen_out_of_collections_and_later_cycles_still_freed():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok")
