"""Differential fuzzing of graphmend (issue 8).

``generator`` draws small ``nn.Module`` programs as source text (hypothesis
strategies); ``runner`` mends each one and compares it, eagerly and compiled,
against the original on inputs that take every side of every branch.

CI mode: ``tests/test_fuzz.py`` (part of ``make test``).
Long mode: ``make fuzz`` (``python -m tests.fuzz --help``).
"""
