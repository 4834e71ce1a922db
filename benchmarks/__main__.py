"""`python -m benchmarks`: see `benchmarks._harness.main`."""

import sys

from benchmarks._harness import main

# The guard matters: anyio's process workers re-import the parent's __main__ module.
if __name__ == "__main__":
    sys.exit(main())
