"""Run several ``ds-train`` command lines in one process, each until it exits.

Usage: ``python -m tests.helpers.cli_calls '[["fit", "--config=a.yaml", "--print_config"], ...]'``. Before each call
it prints ``=== <index>``, after it ``--- exit <code>``; everything the call prints lies between. Only for calls that
end before any training process starts (parsing, ``--print_config``, refused options): one launch spends most of its
time importing Lightning.
"""

import json
import sys
import traceback

from ds_lightning.cli import main

if __name__ == "__main__":
    for index, args in enumerate(json.loads(sys.argv[1])):
        print(f"=== {index}", flush=True)
        code: object = 0
        try:
            main(args)
        except SystemExit as stop:
            code = stop.code if stop.code is not None else 0
        except Exception:  # a refused option: the error is what the test reads
            traceback.print_exc(file=sys.stdout)
            code = 1
        print(f"--- exit {code}", flush=True)
