"""`python -m training ...`: the same as `specjax train ...`."""

import sys

from training.cli import main

sys.exit(main())
