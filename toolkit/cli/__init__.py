"""The commands (``toolkit <command>``, ``python -m toolkit <command>``; ``toolkit/__main__.py`` dispatches).

  recipe  a recipe's main as a process: a ConfigError is one line and exit 2; no teardown on launched ranks
  train   ``toolkit train TASK``: the whole configuration checked in this process, then ``accelerate launch``
  verify  ``toolkit verify``: a launch config against one process
  plan    ``toolkit plan``: which strategy fits, per device
  chat    ``toolkit chat DIR``: talk to an exported model through its chat template
May import: everything.
"""
