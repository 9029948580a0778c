"""Static facts about Python source: parsing, names, tensor-ness and purity, held asserts.

Reads code, runs nothing. Imports only the standard library, torch and
``graphmend.errors``."""
