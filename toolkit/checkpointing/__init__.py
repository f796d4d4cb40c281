"""Checkpoints, as one component: the loop calls ``Checkpointer.load`` once and ``Checkpointer.save`` after each step.

  convert     a checkpoint in a format this launch cannot load, converted beside it (universal, plain)
  resume      what a checkpoint records about the sample order; the checks that refuse a resume that would change it
  staged      a pipeline's checkpoint: its stages written as (and read from) one process's files, by name
  checkpoint  save_state checkpoints (atomic, rotated), their exact load, the final export (``final/``)
  manager     ``plan_resume`` (once, before the weights load; ``check_resume_before_launch``: its refusals in
              ``toolkit train``'s check) and ``Checkpointer`` (what the loop talks to)
May import: errors, layout, env, config, data, models, parallel.
"""

from toolkit.checkpointing.manager import Checkpointer, ResumePlan, check_resume_before_launch, plan_resume

__all__ = ["Checkpointer", "ResumePlan", "check_resume_before_launch", "plan_resume"]
