"""One exception type for bad input, so every front end can print one line and exit 2."""


class UserError(Exception):
    """Bad input from the user: a missing file, a bad config key, a corrupt checkpoint.

    The message is one line that names the problem and what to do about it.
    """


class DivergedError(RuntimeError):
    """Training stopped because the loss kept going NaN/inf after the allowed rollbacks."""
