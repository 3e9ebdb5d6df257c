"""The frozen teacher: loading, its spec, the built-in tiny teacher, the VAE, fp8 quantization."""
