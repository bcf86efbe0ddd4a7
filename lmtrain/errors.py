"""The one base class of every error caused by what a user gave us (config, paths, files, disk)."""


class InputError(ValueError):
    """Bad input, with a message naming it and the way out. Entry points print it and exit with status 2."""
