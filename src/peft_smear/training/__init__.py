"""Helpers for training and watching SMEAR models, built on the PEFT method: routing statistics and their Trainer
callback, the routing report, the routers' own learning rate, a collator that keeps ``smear_task_ids``, and the memory
an adapter will take, checked before it is allocated."""
