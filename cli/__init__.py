"""The ``shardfn`` command line: one module per subcommand, dispatched by :mod:`shardfn.cli.main`.

    shardfn train                                   # llama_tiny on the embedded corpus, on CPU
    shardfn params --config llama3_8b --json        # {"total": ..., "active": ...}

``python -m shardfn.cli`` is the same program as the ``shardfn`` console script.
"""

from shardfn.cli.common import UsageError
from shardfn.cli.main import SUBCOMMANDS, Subcommand, main, register_subcommand

__all__ = ["SUBCOMMANDS", "Subcommand", "UsageError", "main", "register_subcommand"]
