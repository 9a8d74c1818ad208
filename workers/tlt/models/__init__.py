"""The networks: the policy transformer and its fast CPU linear, the EAGLE drafter, loading
(SmolLM2's GGUF, HF folders) and the drafter's export for serving engines."""
