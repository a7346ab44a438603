"""The rule for keeping a step in flight: at most two submitted, the older read back first."""
from collections import deque


def may_submit(in_flight: deque) -> bool:
    """Whether a loop that keeps a step in flight (the engine service's, `step_async`) may
    schedule and submit another step: fewer than two submitted, and not behind a speculative
    step, whose added tokens are known only once it is read."""
    return len(in_flight) < 2 and not (in_flight and in_flight[-1].num_lookahead_slots)


def must_collect(in_flight: deque, submitted: bool) -> bool:
    """Whether that loop reads its oldest step now: two are in flight, or nothing was
    submitted this turn."""
    return bool(in_flight) and (len(in_flight) == 2 or not submitted)
