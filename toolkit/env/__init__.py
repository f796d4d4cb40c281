"""What surrounds a process, read before the training stack loads (no module here imports torch at the top).

  launcher     what ``accelerate launch`` asked for, from its environment: strategy, world size, parallelism sizes
  elastic      torch elastic restarts: the launcher's environment, and a restart continuing its run
  hub          whether the Hugging Face Hub answers (once per process); offline, Hub names fail at once
  upstream     import costs underneath, avoided: transformers' model files read once, its losses without scipy
  host_memory  CPU ranks keep freed memory for reuse (glibc mallopt)
May import: errors, layout.
"""
