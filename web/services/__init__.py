"""The control plane's logic; routes call these, these use web.db."""
