"""A tensor-parallel rank other than 0, as a child process of the offline engine
(services/engine/executor/multiproc.py): `python -m services.worker.follower_process RANK ADDR
TIMEOUT_S JOIN_TIMEOUT_S`, the pickled PagodaConfig on stdin. Nothing heavy is imported before the placement
that the parent put in the environment is applied: OpenMP reads its settings once, when torch
loads it.
"""
import pickle
import sys


def run(config_blob: bytes, rank: int, dist_init_addr: str, group_timeout_s: float,
        join_timeout_s: float) -> None:
    from shared.placement import apply_placement
    apply_placement("worker")
    from services.worker.distributed import GroupBroken
    from services.worker.worker import Worker
    config = pickle.loads(config_blob)
    worker = Worker(config, rank, dist_init_addr, group_timeout_s, join_timeout_s)
    worker.init_device()
    worker.load_model()
    try:
        worker.serve_follower()
    except GroupBroken:
        pass  # the leader's process is gone: so is this one's purpose
    finally:
        worker.group.destroy()


if __name__ == "__main__":
    run(sys.stdin.buffer.read(), int(sys.argv[1]), sys.argv[2], float(sys.argv[3]),
        float(sys.argv[4]))
