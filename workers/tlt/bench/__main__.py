"""`python -m workers.tlt.bench {e2e,rollout,learner,coupling,flips}`: the CLI is cli.py."""

from .cli import main

if __name__ == "__main__":  # importing the package's modules (tests walk them all) runs nothing
    raise SystemExit(main())
