"""One exception type for bad input, so every front end can print one line and exit 2."""


class UserError(Exception):
    """Bad input from the user: a missing file, a bad config key, a corrupt checkpoint.

    The message is one line that names the problem and what to do about it.
    """


class DivergedError(RuntimeError):
    """Training stopped because the loss kept going NaN/inf after the allowed rollbacks."""


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first non-blank line of `err`'s message, spaces collapsed and cut at `limit`
    characters (its type's name when it has none): how a library's error fits in one of ours."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return " ".join((lines[0] if lines else type(err).__name__).split())[:limit]
