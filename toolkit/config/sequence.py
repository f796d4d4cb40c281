"""Sequence parallelism's fields (``sequence_parallel_size``: Ulysses; ``context_parallel_size``: ring attention) and
their checks, a part of ``toolkit.config``'s ``TrainingArguments``: what the split does not run yet is
refused here, before any work; the split itself is ``toolkit.parallel.sequence``'s.

Standard library only (and toolkit.errors, toolkit.config.checks): no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.config.checks import _positive
from toolkit.errors import ConfigError


@dataclass
class SequenceArguments:
    """A part of ``TrainingArguments``: its fields come after that class's own (in --help and config.yaml)."""

    sequence_parallel_size: int = field(
        default=1, metadata={"help": "Ulysses sequence parallelism: the ranks of a group of this many share every "
                                     "sequence, each holding 1/n of its tokens (an all-to-all around attention: heads "
                                     "split instead); data-parallel ranks = world / n, the global batch unchanged. "
                                     "ddp.yaml or fsdp.yaml (FSDP2); causal LM and chat SFT, padded or packed "
                                     "(docs/strategies.md#sequence-parallelism). 1 = off."}
    )
    context_parallel_size: int = field(
        default=1, metadata={"help": "Ring attention: the ranks of a group of this many share every sequence, each "
                                     "holding 1/n of its tokens (a head and a tail chunk), keys/values passed around "
                                     "the ring; any head count. data-parallel ranks = world / n, the global batch "
                                     "unchanged. ddp.yaml or fsdp.yaml (FSDP2); causal LM and chat SFT on padded rows "
                                     "(docs/strategies.md#sequence-parallelism). Not with sequence_parallel_size. "
                                     "1 = off."}
    )

    @property
    def split_size(self) -> int:
        """The ranks that share every sequence (Ulysses' or the ring's group; at most one of them is over 1)."""
        return self.sequence_parallel_size * self.context_parallel_size

    @property
    def split_field(self) -> str:
        """The field that splits the sequence, for messages: the ring's when it is on."""
        return "context_parallel_size" if self.context_parallel_size > 1 else "sequence_parallel_size"

    def _check_sequence(self) -> None:
        """The split's fields, and what it does not run yet, refused before any work."""
        _positive(self, "sequence_parallel_size", "context_parallel_size")
        if self.context_parallel_size > 1 and self.sequence_parallel_size > 1:
            raise ConfigError("context_parallel_size", f"ring attention ({self.context_parallel_size}) with Ulysses "
                                                       f"(sequence_parallel_size {self.sequence_parallel_size}) is not "
                                                       "proven together: set one of them to 1")
        n, field_name = self.split_size, self.split_field
        if n == 1:
            return
        if self.pipeline_parallel_size > 1:
            raise ConfigError(field_name, f"sequence parallelism ({n}) with pipeline parallelism "
                                          f"({self.pipeline_parallel_size}) is not supported: set one of them to 1")
        if self.loss_chunk_size:
            raise ConfigError("loss_chunk_size", f"is not supported with {field_name} {n} yet (each rank's "
                                                 "loss is over its own part of the sequence): leave it 0")
        # each of these is proven equal to one process alone, not yet with sequence parallelism (issue 47's matrix)
        for name, on in (("optim", self.optim == "muon"), ("torch_compile", self.torch_compile),
                         ("async_save", self.async_save)):
            if on:
                value = "muon" if name == "optim" else "true"
                raise ConfigError(name, f"{name} {value} with {field_name} {n} is not proven yet: use one of "
                                        "them, not both")
        if self.loss_normalization != "global_tokens":
            raise ConfigError("loss_normalization", "sequence parallelism normalises by the global batch's target "
                                                    "tokens only: use global_tokens")
