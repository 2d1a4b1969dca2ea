"""`python -m training ...`: the same as `specjax train ...`."""

import sys

from specjax.compile_cache import enable_compile_cache
from training.cli import main

enable_compile_cache()
sys.exit(main())
