"""What survives a process: pickle-free checkpoints and finished run folders."""
