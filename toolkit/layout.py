"""The names of what a run leaves in its ``output_dir``, in one place, and the cheap reads of that folder.

    output_dir/
      config.yaml          the resolved config                           (written by the loop)
      metrics.jsonl        one JSON object per logged step               (metrics; read by report, plots)
      summary.json         world size, strategy, wall time of the run    (loop; read by report)
      loss.png             loss curves                                   (plots)
      runs/                tracker logs (TensorBoard)                    (accelerate's trackers)
      checkpoints/
        step-N/            accelerator.save_state, complete              (checkpoint)
          toolkit_state.json   the loop's position and what the sample order depends on (JSON: never unpickled)
        step-N.tmp/        a save in progress (renamed when every rank is done)
        latest             the name of the newest complete checkpoint
      final/               save_pretrained model + tokenizer             (checkpoint.save_final)

Standard library only, imports no other toolkit module: ``config`` checks the folder through these functions before
any model, process group or torch import.
"""

from __future__ import annotations

import json
import os
import re

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
LOSS_PLOT = "loss.png"
TRACKER_LOGS = "runs"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
FINAL = "final"
CHECKPOINT_STATE = "toolkit_state.json"
TMP_SUFFIX = ".tmp"

_STEP_DIR = re.compile(r"^step-(\d+)$")


def path(output_dir: str, name: str) -> str:
    """``output_dir/name`` for one of the names above."""
    return os.path.join(output_dir, name)


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS)


def step_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, CHECKPOINTS, f"step-{step}")


def final_dir(output_dir: str) -> str:
    return os.path.join(output_dir, FINAL)


def has_final_model(output_dir: str) -> bool:
    """A finished run: ``final/`` holds a saved model."""
    return os.path.isfile(os.path.join(output_dir, FINAL, "config.json"))


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints (``step-N``, never ``step-N.tmp``) as (step, folder), oldest first."""
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> str | None:
    """The checkpoint the ``latest`` pointer names, or the newest complete one if the pointer is missing or stale."""
    root = checkpoints_dir(output_dir)
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        # Only a complete checkpoint's own name counts: never "", "..", another folder or a save in progress.
        if _STEP_DIR.match(name) and os.path.isdir(os.path.join(root, name)):
            return os.path.join(root, name)
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(output_dir: str, resume_from_checkpoint: str | None) -> str | None:
    """The folder a ``resume_from_checkpoint`` value means: None, ``latest`` (in output_dir) or a folder."""
    if resume_from_checkpoint in (None, ""):
        return None
    if resume_from_checkpoint == LATEST:
        return latest_checkpoint(output_dir)
    return resume_from_checkpoint


def read_checkpoint_state(checkpoint: str) -> dict | None:
    """The toolkit's own record inside a checkpoint folder (``toolkit_state.json``), or None if it has none."""
    path = os.path.join(checkpoint, CHECKPOINT_STATE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
