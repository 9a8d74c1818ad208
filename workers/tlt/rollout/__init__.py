"""Generation: the built-in engine, speculative drafting and lossless verification, keyed
sampling, the SD bandit, and the vLLM engine for GPU nodes."""
