"""The runners, one per task: generate/ (decoder LLMs), encode, graph, transcribe/ (whisper), speak (piper
voices) and vad; beside them the paged KV cache (kv) and grammar-constrained decoding (grammar)."""
