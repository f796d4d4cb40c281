"""A run: built from a config, trained by the loop.

  state       LoopState (the loop's position, saved in every checkpoint) and StepResult (no imports)
  build       everything a run trains on, from a config (recipes and the notebook share it)
  newton_schulz  optim muon under FSDP2, HSDP, TP: one owner rank iterates on each sharded matrix, scatters it
  optimizers  optim muon: torch's Muon on the hidden matrices and AdamW on the rest as one optimizer, fp32 iterations
  preemption  SIGTERM -> every rank finishes the step, saves a checkpoint and stops
  loop        train_step (one optimizer step) and train (the outer loop), evaluation
May import: everything but cli.
"""
