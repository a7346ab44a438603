"""Speculative decoding's counters since the engine started (vLLM's spec_decode_* counters)."""
from dataclasses import dataclass, field

from shared.speculative import ACCEPTED_PER_POS_DETAIL


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # sequence-steps that verified at least one proposal
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # proposals accepted
    # accepted_per_pos[j]: drafts whose proposal j (0-based) was accepted
    accepted_per_pos: list[int] = field(default_factory=list)
    num_steps_off: int = 0  # steps that decoded too many sequences to speculate

    def count(self, num_proposed: int, num_accepted: int) -> None:
        """One sequence-step that verified `num_proposed` proposals and accepted the first
        `num_accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for j in range(min(num_accepted, len(self.accepted_per_pos))):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculating sequence emits per step: its accepted proposals plus one."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    def log_summary(self, log) -> None:
        """One log line of the counters (none before the first draft)."""
        if self.num_drafts:
            log.info("speculative decoding", drafts=self.num_drafts,
                     acceptance_rate=round(self.acceptance_rate, 3),
                     mean_accepted_length=round(self.mean_accepted_length, 2),
                     acceptance_per_pos=[round(r, 3) for r in self.acceptance_rate_per_pos()],
                     steps_off=self.num_steps_off)

    def health_details(self) -> dict:
        """The counters as flat health details (one key per position)."""
        details = {"spec_decode_num_drafts": self.num_drafts,
                   "spec_decode_num_draft_tokens": self.num_draft_tokens,
                   "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                   "spec_decode_num_steps_off": self.num_steps_off}
        for pos, accepted in enumerate(self.accepted_per_pos):
            details[f"{ACCEPTED_PER_POS_DETAIL}{pos}"] = accepted
        return details
