"""The user-facing commands: the CLI, its renderers, ``fix``, ``bench`` and
``suite``."""
