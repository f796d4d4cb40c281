"""``python -m toolkit <command>`` (also the ``toolkit`` console script).

  train    one command for a run: TASK (lm, sft, dpo, classify, grpo) checked here, then launched
  verify   run a short job under a launch config and under one process; compare weights and losses
  report   redraw plots and the summary of one or more runs from their metrics.jsonl
  plan     per-device memory of each strategy for a model and a cluster, and which ones fit
  chat     talk to a model a run exported (its final/), through its chat template
  offline  write a real model and tokenizer folder without the Hub: tiny-gpt2, smollm2, minilm, tiny-bert
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"train": "toolkit.cli.train", "verify": "toolkit.cli.verify", "report": "toolkit.reporting.report",
            "plan": "toolkit.cli.plan", "chat": "toolkit.cli.chat", "offline": "toolkit.models.offline"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
