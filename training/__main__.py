"""`python -m specjax.training ...`: the same as `specjax train ...` (same parser, same one-line
errors)."""

import sys

from specjax.cli import command

sys.exit(command(["train", *sys.argv[1:]]))
