"""What a recipe trains: a task turns raw rows into batches and a batch into a loss (``base.Task``).

  base            the Task interface (data, model class, row loss, metrics) every task implements
  lm              CausalLM: causal language modelling on text (``recipes/gpt2.py``)
  sft             ChatSFT: chats, the loss on the assistant's turns only (``recipes/sft.py``)
  classification  labels, class weights, per-example loss, accuracy and macro-F1; SequenceClassification
  reference       DPO's reference model: a live frozen copy sharded like the policy, the adapter disabled, or a whole copy
  dpo             preference pairs (prompt, chosen, rejected), the DPO loss against reference log-probs; the DPO task
  grpo            GRPO: sampled completions, rewards, group advantages, TRL's loss (a package)
May import: errors, layout, loss, env, config, data, models, parallel. A task's module imports no other task's
(``base`` and ``lm`` excepted: the interface, and the causal LM every generative task extends).
"""
