"""Raw rows to batches, for every task: the same rows and the same order whatever the world size.

  packing   padding-free packing: best-fit-decreasing rows of documents, one flattened row per micro-batch, the guard
  loading   loading (Hub, local files, the embedded 'pydoc' text), tokenization, packing, padding
  formats   dataset formats (TRL's, Alpaca, ShareGPT) detected from the columns, converted to a task's schema
  mixture   a task's raw splits: one dataset, or several mixed (dataset_mixture, alignment-handbook's shape)
  order     the global sample order (independent of world size and accumulation)
  stream    the same order for a stream (streaming: true): shuffled windows, g % dp per rank, exact resume
  chat      chat rows: the chat template, the ids of a rendered chat and its assistant-only label mask
  builtin   offline sets: pydoc-chats (chat SFT), pydoc-preferences, stdlib-docstrings (classification)
May import: errors, loss, env, config.
"""
