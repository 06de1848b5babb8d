"""kvbridge's built-in backends, one module each; see :mod:`kvbridge.registry` for their names."""
