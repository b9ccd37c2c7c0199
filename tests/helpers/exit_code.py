"""Exit with this rank's code from the command line: ``python -m tests.helpers.exit_code CODE_RANK0 CODE_RANK1 ...``.

For the runner's own tests (``tests/test_runner.py``): a launch whose ranks exit differently, without training.
"""

import os
import sys

if __name__ == "__main__":
    sys.exit(int(sys.argv[1 + int(os.environ.get("LOCAL_RANK", "0"))]))
