"""The single exception type of the data layer."""


class DataError(ValueError):
    """A data problem the user can fix; the message says what is wrong and how to fix it."""
