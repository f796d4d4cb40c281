"""How the work is spread over ranks.

  ring         ring attention: causal attention over a group's sequence, keys/values passed around, flash kernels
  sequence     sequence parallelism (Ulysses, the ring): the groups, the all-to-all around SDPA, a rank's part of a row
  accelerator  the Accelerator, the CPU shim for DeepSpeed/FSDP/TP on gloo, data-parallel and TP degrees, unwrapping
  clipping     the global gradient norm and clipping, exact on a CPU (torch's fp32 CPU norm kernel is not)
  pipeline     pipeline parallelism: a causal LM cut into stages, torch's schedules, the pp x dp step
May import: errors, layout, loss, env, config, models.
"""
