"""Steps of the mend pipeline beyond a rule's own rewrite (held asserts and
barriers)."""
