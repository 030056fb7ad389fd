"""One exception type for every failure a user can fix: the CLI prints its message on one line."""


class VismmoeError(Exception):
    """A user-facing error: bad input, a broken checkpoint, a missing dependency.

    The message must be one line, name the offending file or value, and say what to do.
    """
