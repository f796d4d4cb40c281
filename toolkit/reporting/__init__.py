"""What a run records, and what reads it back (a training process imports the writers only, never ``report``).

  accounting  FLOPs per token, MFU, peak memory per rank
  metrics     metrics.jsonl (write and read), the log window, summary.json, trackers, progress bar
  plots       loss.png
  report      ``toolkit report``: plots and summaries of finished runs, side by side
May import: layout.
"""
