"""Checkpoints (``accelerator.save_state`` into ``output_dir/checkpoints/step-N``) and the final export.

A checkpoint is written into ``step-N.tmp`` by every rank and renamed to ``step-N`` by the main process only after
all ranks finished, then the ``latest`` pointer is rewritten (write + rename). A run killed mid-save therefore never
leaves a half-written ``step-N``, and ``latest`` always names a complete one. The loop's own state (step, epoch,
position in the epoch, token counters) travels inside the checkpoint through ``register_for_checkpointing``.
"""

from __future__ import annotations

import os
import re
import shutil

from accelerate import Accelerator

CHECKPOINTS = "checkpoints"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS)


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> str | None:
    root = checkpoint_root(output_dir)
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
        if os.path.isdir(path):
            return path
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(output_dir: str, resume_from_checkpoint: str | None) -> str | None:
    if resume_from_checkpoint in (None, ""):
        return None
    if resume_from_checkpoint == "latest":
        return latest_checkpoint(output_dir)
    return resume_from_checkpoint


def save_checkpoint(accelerator: Accelerator, output_dir: str, step: int, save_total_limit: int | None,
                    protect: str | None = None) -> str:
    """Collective: call on every rank. Returns the checkpoint folder."""
    root = checkpoint_root(output_dir)
    final = os.path.join(root, f"step-{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = os.path.join(root, LATEST + ".tmp")
        with open(pointer_tmp, "w") as f:
            f.write(os.path.basename(final))
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer_tmp, os.path.join(root, LATEST))
        _rotate(output_dir, save_total_limit, keep={final, protect})
    accelerator.wait_for_everyone()
    return final


def _rotate(output_dir: str, limit: int | None, keep: set) -> None:
    if not limit:
        return
    found = list_checkpoints(output_dir)
    excess = len(found) - limit
    for _, path in found:
        if excess <= 0:
            break
        if os.path.abspath(path) in {os.path.abspath(k) for k in keep if k}:
            continue
        shutil.rmtree(path, ignore_errors=True)
        excess -= 1


def save_final(accelerator: Accelerator, model, tokenizer, path: str) -> None:
    """Full (unsharded) weights via ``save_pretrained``, loadable by ``AutoModelForCausalLM.from_pretrained``.

    ``get_state_dict`` is collective (it gathers ZeRO-3 / FSDP shards), so every rank calls it; only the main process
    writes. Under ZeRO-3 / FSDP2 the other ranks get None / an empty dict, which is expected.
    """
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        os.makedirs(path, exist_ok=True)
        unwrapped.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    accelerator.wait_for_everyone()
