"""Defaults of the speculative-decoding policy, in one place for the run config
(config.SpecSection, pydantic) and the engine (rollout.SpecPolicy, which a bare GPU node imports
without pydantic)."""

THRESHOLD = 32  # SD may switch on when running sequences <= this (the tail)
EPSILON = 0.1  # bandit exploration probability
BUCKETS = (1, 4, 20)  # bandit buckets by batch size: 1, 2-4, 5-20, 21+
WINDOW = 16  # passes kept per arm and bucket for its rate (tokens / seconds)
STRATEGIES = ((4, 1, 4), (6, 1, 6), (8, 1, 8), (4, 2, 8), (5, 3, 16))  # (depth, top-k, verify)
NGRAM_ARM = True  # also try the n-gram drafter over the row and its siblings
HYBRID_DEPTH = 0  # also try "ngram|d{depth}": the n-gram draft where a row has one, else the drafter (0: no such arm)
DRAFT_VOCAB = 0  # reduced draft vocabulary size (0: the full vocabulary)
DRAFT_TEMPERATURE = 0.0  # sampling: the temperature of the drafter's keyed draws (0: the rollout's own)
DRAFT_BF16 = True  # CPU float32: drafting reads bfloat16 copies of the drafter's weights (linear.draft_in_bfloat16)
# a sampled tree's children at a node are the first to finish the drafter's keyed race, which runs only
# its sampling.RACE_TOKENS likeliest tokens one by one (test_speculative checks the two agree)
MAX_TOPK = 32
