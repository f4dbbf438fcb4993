"""`python -m rlsp.plan ...`: the layout planner's command line (rlsp/plan/cli.py)."""

import sys

from rlsp.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
