"""The real recipe (recipes/gpt2.py) with two test hooks for elastic restarts (``main``: the kill alone, for
scripts/ray_train.py, whose restarts are Ray's).

- Kill: on attempt ``a`` (``TORCHELASTIC_RESTART_COUNT``), rank 1 kills itself with SIGKILL at the end of optimizer
  step ``TOOLKIT_TEST_KILL_AT_STEPS[a]`` (a comma-separated list, one step per attempt, default ``2``: the first
  attempt only; before that step's checkpoint is saved), as a crashed machine would. torch elastic then restarts
  every rank (``--max_restarts``), and the restart resumes on its own (toolkit.config). Attempts past the list run to
  the end.
- Record: once the run's process group is up (``on_prepared``), every rank writes
  ``<output_dir>/probe/elastic_attempt<a>_rank<r>.json``: in which key space of the launcher's rendezvous store the
  group's own store writes. A key is set through the group's store and found again, with the prefix of every layer
  above it, through a plain client of the same store: ``toolkit-attempt-<a>/0//<key>`` for the group
  toolkit.parallel.accelerator starts for the attempt, ``default_pg/0//<key>`` for torch's ``init_process_group`` from the
  environment (the same keys in every attempt, pytorch #135712). The record is the first segment. Written before any
  step, so before rank 1 can die.
"""

import json
import os
import signal
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "recipes"))
import gpt2  # noqa: E402  the recipe itself, unchanged

KILL_AT_STEPS = [int(s) for s in os.environ.get("TOOLKIT_TEST_KILL_AT_STEPS", "2").split(",") if s.strip()]


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class KillRank:
    def on_step_end(self, accelerator, state, row):
        a = attempt()
        if a < len(KILL_AT_STEPS) and accelerator.process_index == 1 and state.step == KILL_AT_STEPS[a]:
            print(f"elastic_run: attempt {a}: rank 1 kills itself after step {state.step}", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class KillRankAndRecordStore(KillRank):
    def __init__(self, output_dir: str):
        self.output_dir = output_dir

    def on_prepared(self, accelerator, model, optimizer):
        import torch.distributed as dist

        a, rank = attempt(), accelerator.process_index
        key = f"elastic_run/attempt{a}/rank{rank}"
        # the group's store as init_process_group kept it (private: no public accessor in torch 2.13)
        dist.distributed_c10d._get_default_store().set(key, "1")
        launcher_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                       timeout=timedelta(seconds=60))
        found = sorted({k.split("/", 1)[0] for k in launcher_store.list_keys() if k.endswith(f"/{key}")})
        os.makedirs(os.path.join(self.output_dir, "probe"), exist_ok=True)
        with open(os.path.join(self.output_dir, "probe", f"elastic_attempt{a}_rank{rank}.json"), "w") as f:
            json.dump({"attempt": a, "rank": rank, "key_space": found}, f)


def main(callbacks=None):
    """The kill alone (scripts/ray_train.py runs this, with its own callbacks: Ray's workers restart through Ray, not
    a torch elastic store)."""
    return gpt2.main(callbacks=[KillRank(), *(callbacks or [])])


if __name__ == "__main__":
    from toolkit.cli.recipe import cli

    out = sys.argv[sys.argv.index("--output_dir") + 1]
    cli(lambda: gpt2.main(callbacks=[KillRankAndRecordStore(out)]))
