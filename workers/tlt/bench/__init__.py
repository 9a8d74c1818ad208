"""Benchmarks (`python -m workers.tlt.bench {e2e,rollout,learner}`) and the bare-GPU check;
each prints one JSON line."""
