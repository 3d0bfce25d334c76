"""Tools for testing tqstream deployments (``rig``: several hosts on one machine)."""
