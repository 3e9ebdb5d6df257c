"""Where a step's inputs come from: prompts and text embeddings, x0 sources, images, teacher latents, held-out data."""
