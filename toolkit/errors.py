"""The toolkit's user-facing error. No imports: every module may raise it, and ``config`` depends on nothing else.

A ``ConfigError`` is a mistake the user can fix in their config or launch command. It names the field and what to do;
``toolkit.cli.recipe.cli`` prints it as one line, ``config error: <field>: <what to do>``, and exits with code 2
(argparse's code for a usage error), before any expensive work and without a traceback.
"""


class TrainingStopped(RuntimeError):
    """The run stopped on purpose mid-way (e.g. a non-finite gradient); the message says why and what is kept.
    ``toolkit.cli.recipe.cli`` prints it as ``training stopped: <message>`` and exits with code 1."""


class ConfigError(ValueError):
    """A bad configuration, reported as ``config error: <field>: <what to do>``."""

    def __init__(self, field_name: str | None, message: str):
        self.field_name, self.message = field_name, message
        super().__init__(f"{field_name}: {message}" if field_name else message)

    def __reduce__(self):
        # Pickled with both arguments (an exception pickles its args, here the one joined string): a ConfigError
        # raised in a Ray Train worker (scripts/ray_train.py) reaches the driver as itself, not as a TypeError.
        return type(self), (self.field_name, self.message)
