"""How well speculation works: drafts proposed and accepted, per request and in total."""
from dataclasses import dataclass


@dataclass
class SpecDecodingStats:
    num_steps: int = 0             # verification steps that had drafts
    num_draft_tokens: int = 0      # drafts proposed (and scored)
    num_accepted_tokens: int = 0   # drafts accepted

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: the accepted drafts and the one the target adds."""
        return 1 + self.num_accepted_tokens / max(self.num_steps, 1)
