"""The best of several timed runs of a micro-benchmark, after one warm-up run."""
import time


def best_seconds(fn, repeats: int, clock=time.perf_counter) -> float:
    """Seconds of the fastest of `repeats` calls of `fn` (one untimed call first)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best
