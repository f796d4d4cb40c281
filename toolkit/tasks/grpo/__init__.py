"""GRPO (TRL 1.16's arithmetic): prompts -> sampled completions -> rewards -> group advantages -> clipped loss.

  sampling  per-row seeded sampling through model.generate: a completion depends on (seed, step, prompt, index)
  loss      completion log-probs, group advantages, the clipped surrogate, loss_types
  rewards   reward functions (import paths, TRL's signature), the built-in arithmetic set and rewards
  task      the GRPO task: the per-step hook that samples and scores, the loss, the metrics
"""
