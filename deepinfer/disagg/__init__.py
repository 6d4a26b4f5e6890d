"""Prefill/decode disaggregation: a prefill engine computes a prompt and its first token, a decode engine
reserves blocks and state slots, reads the prompt's cache from it by component name, and decodes.

layout.py (what a cache holds; the handshake check), plan.py (which byte ranges a request's transfer reads),
transport.py (KVTransport: local, Mooncake Transfer Engine, DLSlime), control.py (ZeroMQ bootstrap service),
connector.py (the engine-side mechanisms of both roles). docs/disaggregation.md has the protocol.
"""
