"""Using a trained model: sampling with a KV cache (``generate``) and held-out loss, perplexity and
bits per byte (``evaluate``)."""
