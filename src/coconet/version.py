"""coconet's version, in a module of its own so every layer can name it without a cycle."""

__version__ = "0.1.0"
