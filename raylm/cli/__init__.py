"""The `raylm` command: train, plan, plot and tokenizer, with flags made from TrainConfig."""
