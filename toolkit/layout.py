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
        step-N.universal/  step-N converted for a launch that cannot load it as written  (convert)
          converted_from.json  the fingerprint of the step-N it was converted from (a re-saved step-N: redone)
        step-N.old.tmp/    the step-N a re-save of step N replaces, while the new one is renamed in
        latest             the name of the newest complete checkpoint
      final/               save_pretrained model + tokenizer             (checkpoint.save_final)
      reference_logps/     DPO's precomputed reference log-probs         (preference; reused by a resume or restart)
        <key>.safetensors  keyed by the reference's weights, the pairs and the precision; kept by overwrite_output_dir

Standard library only, imports no other toolkit module: ``config`` checks the folder through these functions before
any model, process group or torch import.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
LOSS_PLOT = "loss.png"
TRACKER_LOGS = "runs"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
FINAL = "final"
CHECKPOINT_STATE = "toolkit_state.json"
REPLACED_PREFIX = "replaced-"  # output_dir/replaced-<UTC time>/: an earlier run moved aside by overwrite_output_dir
RUN_FILES = (CONFIG, METRICS, SUMMARY, LOSS_PLOT, TRACKER_LOGS, CHECKPOINTS, FINAL)
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old" + TMP_SUFFIX  # step-N.old.tmp: a replaced checkpoint, deleted once the new one is in place
CONVERTED_FROM = "converted_from.json"  # inside step-N.<kind>: the fingerprint of the step-N it was made from
# Not in RUN_FILES: keyed by what it was computed from, so still right for a run that starts over, which writes it
# before the earlier run's files are moved aside.
REFERENCE_LOGPS = "reference_logps"

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


def reference_logps_file(output_dir: str, key: str) -> str:
    """Where DPO's precomputed reference log-probabilities for ``key`` are kept."""
    return os.path.join(output_dir, REFERENCE_LOGPS, f"{key}.safetensors")


def has_final_model(output_dir: str) -> bool:
    """A finished run: ``final/`` holds a saved model."""
    return os.path.isfile(os.path.join(output_dir, FINAL, "config.json"))


def converted_dir(checkpoint: str, kind: str) -> str:
    """Where ``checkpoint`` converted into another format lives: beside it, ``step-N.<kind>`` (never listed as a
    checkpoint of its own; removed with its original)."""
    return os.path.normpath(checkpoint) + "." + kind


def converted_copies(checkpoint: str) -> list[str]:
    """The converted copies of ``checkpoint`` that exist (``step-N.<kind>``, not a save in progress)."""
    parent, name = os.path.split(os.path.normpath(checkpoint))
    if not os.path.isdir(parent):
        return []
    return [os.path.join(parent, n) for n in sorted(os.listdir(parent))
            if n.startswith(name + ".") and not n.endswith(TMP_SUFFIX) and os.path.isdir(os.path.join(parent, n))]


def fingerprint(checkpoint: str) -> str:
    """What identifies one write of ``checkpoint``: the hash of its ``toolkit_state.json`` and of every file's path,
    size and modification time. A re-save of step-N (a rolled-back run saving step N again) changes it, so a copy
    converted from the earlier step-N is known to be stale (``toolkit.checkpointing.convert``)."""
    h = hashlib.sha256()
    state = os.path.join(checkpoint, CHECKPOINT_STATE)
    if os.path.isfile(state):
        with open(state, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    for root, dirs, files in os.walk(checkpoint):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            st = os.stat(full)
            h.update(f"{os.path.relpath(full, checkpoint)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def replace_dir(new: str, target: str) -> None:
    """Rename the complete folder ``new`` to ``target``, replacing an existing ``target`` without a moment where
    neither exists under a name the next run understands: the old one is renamed aside to ``target.old.tmp`` first,
    the new one renamed in, then the old one deleted. A run killed in between leaves ``target.old.tmp``, which
    ``remove_stale_temporaries`` renames back when ``target`` is missing and deletes otherwise."""
    parent = os.path.dirname(os.path.abspath(target))
    old = os.path.normpath(target) + OLD_SUFFIX
    if os.path.lexists(old):
        shutil.rmtree(old)
    if os.path.isdir(target):
        os.replace(target, old)
    os.replace(new, target)
    fsync_dir(parent)
    if os.path.isdir(old):
        shutil.rmtree(old)


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


def belongs_to(checkpoint: str, output_dir: str) -> bool:
    """``checkpoint`` is one of ``output_dir``'s own (under ``output_dir/checkpoints/``, symlinks resolved)."""
    root = os.path.realpath(checkpoints_dir(output_dir))
    return os.path.commonpath([root, os.path.realpath(checkpoint)]) == root


def earlier_run(output_dir: str) -> str | None:
    """What in ``output_dir`` shows that a run already wrote there (a finished model, checkpoints, metrics), or
    None for a folder no run has written to yet."""
    if has_final_model(output_dir):
        return f"a finished run ({FINAL}/)"
    if list_checkpoints(output_dir):
        return f"the checkpoints of a run ({CHECKPOINTS}/)"
    if os.path.isfile(path(output_dir, METRICS)):
        return f"the {METRICS} of a run"
    return None


def checkpoint_step(checkpoint: str) -> int | None:
    """The optimizer step ``checkpoint`` was written at (its ``toolkit_state.json``), or None without one."""
    saved = read_checkpoint_state(checkpoint)
    try:
        return int(saved["loop"]["step"])
    except (TypeError, KeyError, ValueError):
        return None


def read_checkpoint_state(checkpoint: str) -> dict | None:
    """The toolkit's own record inside a checkpoint folder (``toolkit_state.json``), or None if it has none."""
    path = os.path.join(checkpoint, CHECKPOINT_STATE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def move_run_aside(output_dir: str) -> str | None:
    """Move an earlier run's files out of the way (``overwrite_output_dir``) into ``replaced-<UTC time>/`` inside
    output_dir, never deleting them: a new run that died before its first checkpoint would otherwise "resume" the
    old run's checkpoints, and a user's finished run is never destroyed by a flag meant to allow reuse. Returns the
    folder the files went to, or None if there were none."""
    present = [name for name in RUN_FILES if os.path.lexists(os.path.join(output_dir, name))]
    if not present:
        return None
    aside = os.path.join(output_dir, REPLACED_PREFIX + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    suffix = 0
    while os.path.exists(aside + (f"-{suffix}" if suffix else "")):
        suffix += 1
    aside += f"-{suffix}" if suffix else ""
    os.makedirs(aside)
    for name in present:
        shutil.move(os.path.join(output_dir, name), os.path.join(aside, name))
    return aside


def remove_stale_temporaries(output_dir: str) -> list[str]:
    """Delete what a killed save left behind (``checkpoints/step-N.tmp``, ``latest.tmp``, ``final.tmp``, and the
    ``final.old.tmp`` of a re-export killed between its renames: the run that resumes exports again): never a
    complete checkpoint, which is only ever renamed into place once whole."""
    root = checkpoints_dir(output_dir)
    names = os.listdir(root) if os.path.isdir(root) else []
    for name in names:  # a replace killed between its two renames: the old checkpoint is the complete one
        kept = name[: -len(OLD_SUFFIX)]
        if name.endswith(OLD_SUFFIX) and _STEP_DIR.match(kept) and not os.path.lexists(os.path.join(root, kept)):
            os.replace(os.path.join(root, name), os.path.join(root, kept))
    names = os.listdir(root) if os.path.isdir(root) else []
    stale = [os.path.join(root, n) for n in names if n.endswith(TMP_SUFFIX)]
    stale += [p for p in [os.path.join(output_dir, FINAL + suffix) for suffix in (TMP_SUFFIX, OLD_SUFFIX)]
              if os.path.lexists(p)]
    for path in stale:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return stale


def fsync_tree(path: str) -> None:
    """Flush every file and folder below ``path`` to disk, so that a rename after it publishes complete data even
    across a power loss (rename is atomic, but only orders what was already durable)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
