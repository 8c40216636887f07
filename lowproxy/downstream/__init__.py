"""Downstream: the side towards clients.

``server`` accepts connections, ``connection`` runs h11 request/response cycles
on one of them, ``limits`` bounds what a client may send, ``responder`` writes a
response with flow control, and ``messages`` is all the rest of lowproxy sees of a
client: the ``ClientRequest`` and ``ResponseWriter`` protocols.
"""

from .limits import Limits
from .messages import AbortResponse, ClientGone, ClientRequest, ResponseWriter
from .server import HttpServer

__all__ = ["AbortResponse", "ClientGone", "ClientRequest", "HttpServer", "Limits",
           "ResponseWriter"]
