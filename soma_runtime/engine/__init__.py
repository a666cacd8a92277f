"""Generation: paged KV cache, sampling, and the prefill -> decode loop."""
