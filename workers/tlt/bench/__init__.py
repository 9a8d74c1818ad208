"""Benchmarks (`python -m workers.tlt.bench {e2e,rollout,learner,coupling}`) and the bare-GPU check;
each prints one JSON line."""
