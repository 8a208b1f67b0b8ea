"""``python -m shardfn.cli``: the ``shardfn`` console script."""

import sys

from shardfn.cli.main import main

sys.exit(main())
