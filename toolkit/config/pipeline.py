"""Pipeline parallelism's fields (stages, schedule, stages per rank) and their checks, a part of
``toolkit.config``'s ``TrainingArguments``: what a pipeline does not run yet is refused here, before any work; the
pipeline itself is ``toolkit.parallel.pipeline``'s.

Standard library only (and toolkit.errors, toolkit.config.checks): no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.config.checks import _one_of, _positive
from toolkit.errors import ConfigError

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # torch.distributed.pipelining's schedules


@dataclass
class PipelineArguments:
    """A part of ``TrainingArguments``: its fields come after that class's own (in --help and config.yaml)."""

    pipeline_parallel_size: int = field(
        default=1, metadata={"help": "Pipeline stages: the model's decoder layers cut into this many stages, one per "
                                     "rank of a pipeline; ranks = pipeline_parallel_size x data-parallel replicas "
                                     "(ddp.yaml; docs/strategies.md#pipeline-parallelism). 1 = off."}
    )
    pipeline_schedule: str = field(
        default="1f1b", metadata={"help": "The pipeline's schedule (torch.distributed.pipelining's): gpipe, 1f1b or "
                                          "interleaved_1f1b; its micro-batches are the gradient_accumulation_steps."}
    )
    pipeline_stages_per_rank: int = field(
        default=1, metadata={"help": "Stages each rank holds (interleaved_1f1b only: 2 or more; the others take 1)."}
    )

    def _check_pipeline(self) -> None:
        """Pipeline parallelism's fields, and what it does not run yet, refused before any work."""
        _positive(self, "pipeline_parallel_size", "pipeline_stages_per_rank")
        _one_of(self, "pipeline_schedule", PIPELINE_SCHEDULES)
        interleaved = self.pipeline_schedule == "interleaved_1f1b"
        if self.pipeline_parallel_size > 1 and interleaved != (self.pipeline_stages_per_rank > 1):
            raise ConfigError("pipeline_stages_per_rank",
                              "interleaved_1f1b needs 2 or more stages per rank, gpipe and 1f1b exactly 1; got "
                              f"{self.pipeline_stages_per_rank} with {self.pipeline_schedule}")
        if self.pipeline_parallel_size == 1:
            return
        m, stages = self.gradient_accumulation_steps, self.pipeline_parallel_size
        if (self.pipeline_schedule == "1f1b" and m < stages) or (interleaved and m % stages):
            need = f"at least {stages}" if self.pipeline_schedule == "1f1b" else f"a multiple of {stages}"
            raise ConfigError("gradient_accumulation_steps",
                              f"is the pipeline's micro-batches: {self.pipeline_schedule} with {stages} stages needs "
                              f"{need} (torch's schedule), got {m}; raise it (fewer rows per micro-batch keep the "
                              "global batch) or use gpipe")
        if self.loss_chunk_size:
            raise ConfigError("loss_chunk_size", f"is not supported with pipeline_parallel_size "
                                                 f"{self.pipeline_parallel_size} yet (the last stage computes the whole "
                                                 "loss): leave it 0, or train with pipeline_parallel_size 1")
        if self.loss_normalization != "global_tokens":
            raise ConfigError("loss_normalization", "a pipeline normalises by the global batch's target tokens only: "
                                                    "use global_tokens")
