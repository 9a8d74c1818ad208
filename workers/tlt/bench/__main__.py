"""`python -m workers.tlt.bench {e2e,rollout,learner,coupling}`: the CLI is cli.py."""

from .cli import main

raise SystemExit(main())
