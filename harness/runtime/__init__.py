"""What runs inside a rank: the training context, determinism, checkpoints, fingerprints. Torch yes, MLflow never."""
