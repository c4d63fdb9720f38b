"""``python -m gradwatch``: the ``gradwatch`` command (see :mod:`gradwatch.cli`)."""

import sys

from gradwatch.cli import main

if __name__ == "__main__":
    sys.exit(main())
