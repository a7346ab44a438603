"""The tensor-parallel group of one worker replica, over torch.distributed.

Rank 0 (the leader) hosts the rendezvous store at the stack's `dist_init_addr` and is the only
rank the engine sends steps to: it relays every frame to the other ranks (the followers) with
one broadcast, so a step is sent once whatever the group's size. Collectives run on the
device's backend (gloo on the CPU, NCCL on CUDA); frames and sampled tokens always cross on a
gloo group, since they live in host memory.

A rank that dies, or a collective that times out, breaks the group for good: every surviving
rank then sees `GroupBroken` in its next collective and its process exits, and the group is
formed again by the restarted processes (services/worker/main.py). While the engine sends
nothing, the leader pings the group now and then, so that a follower's death is noticed even
when no step runs.
"""
import datetime
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_PING = b""  # a frame with nothing in it: a liveness round, not a message


class GroupBroken(RuntimeError):
    """A rank of the tensor-parallel group is gone (or a collective timed out): the group
    cannot be used again."""


def parse_init_addr(addr: str) -> tuple[str, int]:
    """"tcp://host:port" -> (host, port)."""
    if not addr.startswith("tcp://") or ":" not in addr[6:]:
        raise ValueError(f"dist_init_addr must be tcp://host:port, got {addr!r}")
    host, port = addr[6:].rsplit(":", 1)
    return host.strip("[]"), int(port)


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    device: torch.device
    cpu_group: object  # gloo: frames, tokens, block counts
    device_group: object  # the device's backend: activations and logits
    store_socket: socket.socket | None = field(default=None, repr=False)  # rank 0's listener

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def create(cls, rank: int, world_size: int, init_addr: str, device: torch.device,
               timeout_s: float, join_timeout_s: float = 120.0) -> "TensorParallelGroup":
        """Join the group: blocks until every rank has (at most `join_timeout_s`); rank 0
        hosts the store. A collective may then wait `timeout_s` for a rank."""
        host, port = parse_init_addr(init_addr)
        timeout = datetime.timedelta(seconds=timeout_s)
        join_timeout = datetime.timedelta(seconds=join_timeout_s)
        listener = None
        if rank == 0:
            # Listening on the given address only (the store alone would take every
            # interface), from a socket held while the group lives.
            listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(world_size)
        try:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                                  timeout=join_timeout, wait_for_workers=True,
                                  master_listen_fd=listener.fileno() if listener else None)
        except RuntimeError as e:
            if listener is not None:
                listener.close()
            raise GroupBroken(f"the tensor-parallel group did not form at {init_addr} within "
                              f"{join_timeout_s:g} s: {e}") from e
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        device_group = dist.group.WORLD
        cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo",
                                                                          timeout=timeout)
        return cls(rank, world_size, device, cpu_group, device_group, listener)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.store_socket is not None:
            self.store_socket.close()
            self.store_socket = None

    # -- activations ---------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        with _broken_on_error("all_reduce"):
            dist.all_reduce(x, group=self.device_group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each rank's [..., n] (the same n on every rank) -> [..., world_size * n] on the
        leader, ranks in order; None on the others."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_leader else None
        with _broken_on_error("gather"):
            dist.gather(x, parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1) if self.is_leader else None

    # -- host-side messages --------------------------------------------------------------------
    def broadcast_frame(self, frame: bytes) -> None:
        """Leader: send one encoded message to every follower."""
        size = torch.tensor([len(frame)], dtype=torch.int64)
        with _broken_on_error("broadcast"):
            dist.broadcast(size, src=0, group=self.cpu_group)
            if frame:
                data = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
                dist.broadcast(data, src=0, group=self.cpu_group)
            else:
                self._ping_round()

    def receive_frame(self) -> bytes | None:
        """Follower: the leader's next message; None for a ping (answered here)."""
        size = torch.zeros(1, dtype=torch.int64)
        with _broken_on_error("broadcast"):
            dist.broadcast(size, src=0, group=self.cpu_group)
            if int(size) == 0:
                self._ping_round()
                return None
            data = torch.empty(int(size), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.cpu_group)
        return data.numpy().tobytes()

    def ping(self) -> None:
        """Leader: a round every rank must answer; raises GroupBroken if one cannot."""
        self.broadcast_frame(_PING)

    def _ping_round(self) -> None:
        # A reduction needs an answer from every rank, so a dead one fails it (a broadcast
        # alone might be buffered by the kernel and succeed).
        dist.all_reduce(torch.zeros(1), group=self.cpu_group)

    def broadcast_ints(self, values: list[int] | None, count: int) -> list[int]:
        """The leader's `count` integers on every rank (`values` is read on the leader only)."""
        t = (torch.tensor(values, dtype=torch.int64) if self.is_leader
             else torch.empty(count, dtype=torch.int64))
        if count:
            with _broken_on_error("broadcast"):
                dist.broadcast(t, src=0, group=self.cpu_group)
        return t.tolist()

    def min_ints(self, values: list[int]) -> list[int]:
        """Element-wise minimum over the ranks."""
        t = torch.tensor(values, dtype=torch.int64)
        with _broken_on_error("all_reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return t.tolist()


class _broken_on_error:
    """Turns a failed collective (a peer's socket closed, a timeout) into GroupBroken."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and isinstance(exc, RuntimeError) and not isinstance(exc, GroupBroken):
            raise GroupBroken(f"tensor-parallel {self.what} failed: {exc}") from exc
        return False
