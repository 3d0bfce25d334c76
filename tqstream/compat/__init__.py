"""Compatibility layers that let code written against other data-plane APIs run on tqstream."""
