"""The Ray side: rollout-worker actors, the FSDP2 learner group and its placement, weight
sync, spot drafter training on idle workers, and the idle-time accounting."""
