"""What a Ray worker runs for one trial: the trainer, its spec and result, coord checks."""
