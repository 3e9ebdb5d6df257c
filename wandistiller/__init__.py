"""WanDistiller: distill a large Wan video diffusion transformer into a small text-to-image student."""
