"""The reference pipeline: weight sync, rollout engines, a decoupled-PPO trainer and the demo.

Imported lazily (``import tqstream`` does not load it); nothing here is needed to use the data
plane.
"""
