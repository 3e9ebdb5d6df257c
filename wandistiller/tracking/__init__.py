"""Loggers (wandb, none) and sweep reports."""
