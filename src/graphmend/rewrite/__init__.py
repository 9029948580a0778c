"""Applying rules to live functions: the engine that locates, rewrites and
installs code, the backend fallback, and verification against eager."""
