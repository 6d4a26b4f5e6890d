"""Data-parallel routing: which engine replica serves a request (docs/serving.md, "Data-parallel routing").

policy.py holds the decision as a pure function of what the router knows (each replica's cached block hashes,
its load, the request's block hashes and sticky key); state.py keeps that knowledge between load refreshes.
"""
