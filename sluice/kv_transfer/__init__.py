"""Moving KV cache blocks beyond one engine: the global KV pool (`pool/`) shared by instances."""
