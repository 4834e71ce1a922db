"""``tether serve``: JSON-RPC over HTTP and server-sent events in front of one Runtime.

Outside the engine (``tether.runtime``): it only uses the public ``Runtime`` API.
"""
