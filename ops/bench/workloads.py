"""The offline benchmark's workloads: random-token prompts, the same for every system.

`fixed` is `num_prompts` prompts of `input_len` tokens; `mixed` is `num_prompts` prompts whose
lengths are drawn uniformly from a range. Each round of a run gets fresh tokens (so that no
prefix cache carries over from the round before) in the same lengths (so that every round does
the same work and their times compare). Everything is drawn from the seed.
"""
import random
from dataclasses import dataclass

WORKLOAD_NAMES = ("fixed", "mixed")


def make_prompts(vocab_size: int, special_ids: set[int], lengths: list[int],
                 seed: int | str) -> list[list[int]]:
    """One prompt of random non-special tokens per length."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


def make_workload(vocab_size: int, special_ids: set[int], num_prompts: int, input_len: int,
                  seed: int) -> list[list[int]]:
    """`num_prompts` prompts of `input_len` random tokens."""
    return make_prompts(vocab_size, special_ids, [input_len] * num_prompts, seed)


def draw_lengths(num_prompts: int, low: int, high: int, seed: int) -> list[int]:
    """Prompt lengths drawn uniformly from [low, high], both included."""
    rng = random.Random(f"lengths-{seed}")
    return [rng.randint(low, high) for _ in range(num_prompts)]


@dataclass
class Workload:
    """A named workload: every round's prompts (fresh tokens, the same lengths)."""

    name: str
    rounds: list[list[list[int]]]
    description: str = ""

    def __post_init__(self):
        lengths = [len(p) for p in self.rounds[0]]
        if any([len(p) for p in prompts] != lengths for prompts in self.rounds):
            raise ValueError(f"workload {self.name}: rounds differ in their prompt lengths")

    @property
    def num_prompts(self) -> int:
        return len(self.rounds[0])

    @property
    def input_tokens(self) -> int:
        """The prompt tokens of one round (the same in every round)."""
        return sum(len(p) for p in self.rounds[0])

    def summary(self) -> dict:
        lengths = [len(p) for p in self.rounds[0]]
        return {"name": self.name, "num_prompts": self.num_prompts,
                "input_tokens": self.input_tokens, "input_len_min": min(lengths),
                "input_len_max": max(lengths), "rounds": len(self.rounds)}


def build_workloads(names: list[str], vocab_size: int, special_ids: set[int], num_prompts: int,
                    input_len: int, input_len_range: tuple[int, int], rounds: int,
                    seed: int) -> list[Workload]:
    """The named workloads, each with `rounds` rounds of prompts. Round r of `fixed` is the
    workload the benchmark has always run with seed + r; `mixed` draws its tokens from a seed of
    its own, so that its prompts never share a prefix with `fixed`'s."""
    if len(set(names)) != len(names):
        raise SystemExit(f"--workloads names a workload twice: {' '.join(names)}")
    low, high = input_len_range
    if "mixed" in names and not 1 <= low <= high:
        raise SystemExit(f"--input-len-range must be two lengths, 1 <= LOW <= HIGH; got {low} "
                         f"{high}")
    workloads = []
    for name in names:
        if name == "fixed":
            lengths = [input_len] * num_prompts
            seeds = [seed + r for r in range(rounds)]
            description = f"{num_prompts} prompts x {input_len} input tokens"
        elif name == "mixed":
            lengths = draw_lengths(num_prompts, low, high, seed)
            seeds = [f"mixed-{seed + r}" for r in range(rounds)]
            description = (f"{num_prompts} prompts x {low}-{high} input tokens "
                           f"({sum(lengths)} in all)")
        else:
            raise SystemExit(f"--workloads: unknown workload {name!r} (known: "
                             f"{', '.join(WORKLOAD_NAMES)})")
        workloads.append(Workload(name, [make_prompts(vocab_size, special_ids, lengths, s)
                                         for s in seeds], description))
    return workloads
